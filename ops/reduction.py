"""Reductions: a split reduced dim leaves each rank a partial result (P for sum/mean, P(max)/P(min))."""
from __future__ import annotations

import math

import torch

from .registry import PMAX, PMIN, B, Ctx, Local, P, Rule, S, aten, register


def reduced_dims(ctx: Ctx) -> tuple[list[int], bool]:
    nd = len(ctx.shapes[0])
    if all(a.name != "dim" for a in ctx.func._schema.arguments):
        return list(range(nd)), False
    dims = ctx.arg(1, "dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = range(nd)
    elif isinstance(dims, int):
        dims = [dims]
    return sorted({d % max(nd, 1) for d in dims}), bool(ctx.arg(2, "keepdim", False))


def reduction(partial, n_out: int = 1) -> Rule:
    """Split non-reduced dims pass through; a split reduced dim gives `partial` (None: not allowed)."""
    def signatures(ctx: Ctx) -> list:
        dims, keep = reduced_dims(ctx)
        sigs = []
        for d in range(len(ctx.shapes[0])):
            if d in dims:
                if partial is not None:
                    sigs.append(((S(d),), (partial,) * n_out))
            else:
                sigs.append(((S(d),), (S(d if keep else d - sum(r < d for r in dims)),) * n_out))
        if partial is not None:
            sigs.append(((partial,), (partial,) * n_out))
        return sigs
    return Rule(signatures)


def mean_local(func, args, kwargs, where: Local):
    """Sum the shard, divide by the global count: the shards' results add up to the mean."""
    dims, keep = reduced_dims(where.ctx)
    count = math.prod(where.ctx.shapes[0][d] for d in dims)
    dtype = kwargs.get("dtype", args[3] if len(args) > 3 else None)
    return aten.sum.dim_IntList(args[0], dims, keep, dtype=dtype) / count


SUM = reduction(P)
register([aten.sum.default, aten.sum.dim_IntList], SUM)
register([aten.mean.default, aten.mean.dim], Rule(SUM.signatures, local=mean_local))
def extreme_local(identity: str):
    """max()/min() of an empty shard (a split smaller than the mesh) is the reduction's identity."""
    def local(func, args, kwargs, where: Local):
        x = args[0]
        if x.numel() or func not in (aten.max.default, aten.min.default):
            return func(*args, **kwargs)
        info = torch.finfo(x.dtype) if x.dtype.is_floating_point else torch.iinfo(x.dtype)
        value = {"max": -math.inf if x.dtype.is_floating_point else info.min,
                 "min": math.inf if x.dtype.is_floating_point else info.max}[identity]
        return x.new_full((), value)
    return local


register([aten.amax.default, aten.max.default], Rule(reduction(PMAX).signatures, local=extreme_local("max")))
register([aten.amin.default, aten.min.default], Rule(reduction(PMIN).signatures, local=extreme_local("min")))
register([aten.max.dim, aten.min.dim], reduction(None, n_out=2))
register([aten.argmax.default, aten.argmin.default], reduction(None))


# -- scans and counts ----------------------------------------------------------------------------
def scan_signatures(ctx: Ctx) -> list:
    """cumsum: a split of another dim passes; the scanned dim is taken whole. Linear: P passes."""
    n = len(ctx.shapes[0])
    dim = ctx.named("dim") % max(n, 1)
    dtype = ctx.kwargs.get("dtype")
    linear = dtype is None or dtype.is_floating_point or dtype.is_complex  # an int cast of P would truncate
    return [((S(d),), (S(d),)) for d in range(n) if d != dim] + ([((P,), (P,))] if linear else [])


def _histc_range(args: tuple, kwargs: dict) -> bool:
    lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
    hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return lo < hi


def histc_signatures(ctx: Ctx) -> list:
    """A split input anywhere: each rank counts its own elements, the counts add up (P). With
    min == max torch takes the range from the data, which a shard does not know: taken whole."""
    if not _histc_range(ctx.args, ctx.kwargs):
        return []
    return [((S(d),), (P,)) for d in range(len(ctx.shapes[0]))]


register([aten.cumsum.default], Rule(scan_signatures))
register([aten.histc.default], Rule(histc_signatures, scalar_key=_histc_range))
