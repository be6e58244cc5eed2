"""`linalg_vector_norm` (what `clip_grad_norm_` and `F.normalize` call): split kept dims pass; a split
reduced dim is decomposed into a sum (or max) of the local pieces and the root of the reduced value.

So the norm of a sharded gradient (ZeRO) costs a scalar all-reduce, never a gather of the gradient.
A Partial input is reduced first (the norm of a sum is not a sum of norms).
"""
from __future__ import annotations

import math
from typing import Any

from ..layout import Layout
from ..sbp import Broadcast, Partial
from .arguments import named_args, reduced_dims
from .inputs import defer_reduction, settle
from .registry import Ctx, Rule, S, aten, register, split_on


def parse(func: Any, args: tuple, kwargs: dict) -> tuple[float, list[int], bool]:
    named = named_args(func, args, kwargs)
    return float(named.get("ord", 2)), reduced_dims(named, args[0].dim()), bool(named.get("keepdim", False))


def signatures(ctx: Ctx) -> list:
    _, dims, keep = parse(ctx.func, ctx.args, ctx.kwargs)
    return [((S(d),), (S(d if keep else d - sum(r < d for r in dims)),))
            for d in range(len(ctx.shapes[0])) if d not in dims]


def reduced_dim_split(ctx: Ctx, layouts: tuple) -> bool:
    _, dims, _ = parse(ctx.func, ctx.args, ctx.kwargs)
    return any(split_on(layouts[0], d) for d in dims)


def split_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """The p-norm as (sum |x|^p)^(1/p), the inf-norms as max/min |x|, the 0-"norm" as a count."""
    x = args[0]
    settle(x)  # a gradient noted for the step's bucket: converted there first, its norm then local
    order, dims, keep = parse(func, args, kwargs)
    named = named_args(func, args, kwargs)
    if named.get("dtype") is not None:
        x = aten._to_copy.default(x, dtype=named["dtype"])
    a = aten.abs.default(x)
    if math.isinf(order):
        return (aten.amax.default if order > 0 else aten.amin.default)(a, dims, keep)
    if order == 0:
        return aten.sum.dim_IntList(aten._to_copy.default(aten.ne.Scalar(a, 0), dtype=a.dtype), dims, keep)
    if order == 1:
        return aten.sum.dim_IntList(a, dims, keep)
    if order == 2:
        return aten.sqrt.default(aten.sum.dim_IntList(aten.mul.Tensor(a, a), dims, keep))
    return aten.pow.Tensor_Scalar(aten.sum.dim_IntList(aten.pow.Tensor_Scalar(a, order), dims, keep), 1.0 / order)


register([aten.linalg_vector_norm.default], Rule(signatures, decompose=split_norm, decompose_when=reduced_dim_split))


def _root(s: Any, order: float) -> Any:
    if math.isinf(order) or order in (0, 1):
        return s
    return aten.sqrt.default(s) if order == 2 else aten.pow.Tensor_Scalar(s, 1.0 / order)


def _powered_sum(x: Any, order: float) -> Any:
    """What the root is taken of: sum |x|^p (max/min |x| for the inf-norms, the count for p = 0)."""
    a = aten.abs.default(x)
    dims = list(range(x.dim()))
    if math.isinf(order):
        return (aten.amax.default if order > 0 else aten.amin.default)(a, dims)
    if order == 0:
        return aten.sum.default(aten._to_copy.default(aten.ne.Scalar(a, 0), dtype=a.dtype))
    if order == 1:
        return aten.sum.default(a)
    return aten.sum.default(aten.mul.Tensor(a, a) if order == 2 else aten.pow.Tensor_Scalar(a, order))


def foreach_norm(func: Any, args: tuple, kwargs: dict) -> list:
    """Every tensor's norm; the partial sums of sharded tensors are reduced together, one all-reduce for
    the list (`clip_grad_norm_(foreach=True)` over ZeRO gradients), before any root is taken."""
    tensors, order = args[0], float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    if kwargs.get("dtype") is not None:
        tensors = [aten._to_copy.default(t, dtype=kwargs["dtype"]) for t in tensors]
    for t in tensors:  # gradients noted for the step's bucket: reduced there first (clip_grad_norm_'s read)
        settle(t)
    sums = [_powered_sum(t, order) for t in tensors]
    for s in sums:  # pending: the first read reduces all of them in one collective per bucket
        lay = getattr(s, "_layout", None)
        if lay is not None and lay.has_partial:
            defer_reduction(s, Layout(lay.placement, tuple(Broadcast() if isinstance(p, Partial) else p
                                                          for p in lay.sbp)))
    return [_root(s, order) for s in sums]


register([aten._foreach_norm.Scalar], Rule(lambda ctx: [], decompose=foreach_norm))
