"""`var`, `std`, `var_mean`, `std_mean`: split non-reduced dims pass; a split reduced dim is decomposed.

The variance over a split dim is two reductions, each made whole once (a [kept dims]-sized all-reduce):
the mean, then the sum of squared deviations, divided by `N - correction` as torch does. The input
never moves. A Partial input is reduced first (the variance of a sum is not a sum of variances).
"""
from __future__ import annotations

import math
from typing import Any

from .arguments import named_args, reduced_dims
from .registry import Ctx, Rule, S, aten, register, split_on


def parse(func: Any, args: tuple, kwargs: dict) -> tuple[list[int], float, bool]:
    """(reduced dims, correction, keepdim) of any overload (`unbiased=` is correction 1 or 0)."""
    named = named_args(func, args, kwargs)
    dims = reduced_dims(named, args[0].dim())
    if "correction" in named:
        correction = 1 if named["correction"] is None else named["correction"]
    else:
        correction = 1 if named.get("unbiased", True) else 0
    return dims, correction, bool(named.get("keepdim", False))


def signatures(ctx: Ctx) -> list:
    dims, _, keep = parse(ctx.func, ctx.args, ctx.kwargs)
    n_out = len(ctx.out_shapes)
    return [((S(d),), (S(d if keep else d - sum(r < d for r in dims)),) * n_out)
            for d in range(len(ctx.shapes[0])) if d not in dims]


def reduced_dim_split(ctx: Ctx, layouts: tuple) -> bool:
    if not ctx.args[0].dtype.is_floating_point:
        return False
    dims, _, _ = parse(ctx.func, ctx.args, ctx.kwargs)
    return any(split_on(layouts[0], d) for d in dims)


def split_variance(func: Any, args: tuple, kwargs: dict) -> Any:
    """mean, then sum((x - mean)^2) / (N - correction); sqrt for std; with the mean for *_mean.

    The square is `pow`, not `mul(d, d)`: a call whose two slots hold one tensor is priced as one
    boxing, but the decision cache does not key on aliasing (see the report of issue 17).
    """
    x = args[0]
    dims, correction, keep = parse(func, args, kwargs)
    n = math.prod(x.shape[d] for d in dims)
    mean = aten.mean.dim(x, dims, True)
    dev = aten.sub.Tensor(x, mean)
    out = aten.div.Scalar(aten.sum.dim_IntList(aten.pow.Tensor_Scalar(dev, 2), dims, keep), max(n - correction, 0))
    name = func._schema.name
    if name in ("aten::std", "aten::std_mean"):
        out = aten.sqrt.default(out)
    if name.endswith("_mean"):
        return out, (mean if keep else aten.view.default(mean, list(out.shape)))
    return out


OPS = [getattr(packet, o) for packet in (aten.var, aten.std, aten.var_mean, aten.std_mean)
       for o in ("default", "dim", "correction") if hasattr(packet, o)]
register(OPS, Rule(signatures, decompose=split_variance, decompose_when=reduced_dim_split))
