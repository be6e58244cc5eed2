"""Reductions: a split reduced dim leaves each rank a partial result (P for sum/mean, P(max)/P(min))."""
from __future__ import annotations

import math
from typing import Any

import torch

from ..runtime import context
from .registry import PMAX, PMIN, Ctx, ShardSite, P, Rule, S, aten, is_inplace, register


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


def mean_local(func, args, kwargs, where: ShardSite):
    """Sum the shard, divide by the global count: the shards' results add up to the mean."""
    dims, keep = reduced_dims(where.ctx)
    shape = where.ctx.shapes[0]
    count = math.prod(shape[d] for d in dims if d < len(shape))  # a 0-d input's dim 0 is itself
    dtype = kwargs.get("dtype", args[3] if len(args) > 3 else None)
    return aten.sum.dim_IntList(args[0], dims, keep, dtype=dtype) / count


SUM = reduction(P)
register([aten.sum.default, aten.sum.dim_IntList], SUM)
register([aten.mean.default, aten.mean.dim], Rule(SUM.signatures, kernel=mean_local))
def extreme_local(identity: str):
    """max()/min() of an empty shard (a split smaller than the mesh) is the reduction's identity."""
    def local(func, args, kwargs, where: ShardSite):
        x = args[0]
        if x.numel() or func not in (aten.max.default, aten.min.default):
            return func(*args, **kwargs)
        info = torch.finfo(x.dtype) if x.dtype.is_floating_point else torch.iinfo(x.dtype)
        value = {"max": -math.inf if x.dtype.is_floating_point else info.min,
                 "min": math.inf if x.dtype.is_floating_point else info.max}[identity]
        return x.new_full((), value)
    return local


register([aten.amax.default, aten.max.default], Rule(reduction(PMAX).signatures, kernel=extreme_local("max")))
register([aten.amin.default, aten.min.default], Rule(reduction(PMIN).signatures, kernel=extreme_local("min")))
register([aten.max.dim, aten.min.dim], reduction(None, n_out=2))
register([aten.argmax.default, aten.argmin.default], reduction(None))


# -- scans and counts ----------------------------------------------------------------------------
# cumsum / cumprod (and their in-place forms) and logcumsumexp (its combine is logaddexp) along a split
# dim run as a distributed scan: each rank scans its shard, the ranks of the mesh axes that split the dim
# all-gather their shards' totals (the scan's last row: one row of the dim's cross-section per rank), and
# each rank combines into its scan the totals of the ranks before it in the split's order. Several mesh
# axes splitting the dim (mesh axis 0 cuts first) are scanned innermost axis first: the totals gathered on
# an axis give the rank's offset within its outer piece and that piece's total, which the next axis out
# gathers in turn, so a rank receives (n_a - 1) rows per such axis a, not (prod n_a - 1). Output: the
# same Split.
SCANS = {aten.cumsum.default: "sum", aten.cumsum_.default: "sum",
         aten.cumprod.default: "prod", aten.cumprod_.default: "prod", aten.logcumsumexp.default: "logsumexp"}


def scan_axes(layout: Any, dim: int) -> tuple[int, ...]:
    """The mesh axes (of more than one rank) whose Split cuts `dim`, outermost first."""
    return tuple(a for a, s in enumerate(layout.sbp) if s == S(dim) and layout.placement.shape[a] > 1)


def _scan_dim(ctx: Ctx) -> int:
    return ctx.named("dim") % max(len(ctx.shapes[0]), 1)


def scan_signatures(ctx: Ctx) -> list:
    """A split of another dim passes; a split of the scanned dim stays split, the kernel exchanging
    the shards' totals (`scan_local`, charged by `scan_cost`). Linear (cumsum): P passes too."""
    n = len(ctx.shapes[0])
    dtype = ctx.kwargs.get("dtype")
    linear = SCANS[ctx.func] == "sum" and (dtype is None or dtype.is_floating_point or dtype.is_complex)
    # (an int cast of P would truncate; a product of partial sums is no partial product)
    return [((S(d),), (S(d),)) for d in range(n)] + ([((P,), (P,))] if linear else [])


def _scan_dtype(ctx: Ctx) -> torch.dtype:
    """The result's dtype: `dtype=`, else the input's, integers (and bool) widened to int64 as torch does;
    an in-place scan keeps its target's."""
    x = ctx.args[0]
    if ctx.func in (aten.cumsum_.default, aten.cumprod_.default):
        return x.dtype
    dtype = ctx.kwargs.get("dtype")
    if dtype is not None:
        return dtype
    return x.dtype if x.dtype.is_floating_point or x.dtype.is_complex else torch.int64


def scan_cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> tuple:
    """What the scan's kernel receives: on each mesh axis a that splits the scanned dim, the other
    n_a - 1 ranks' totals (a row of the rank's cross-section of the dim), one all-gather per axis."""
    dim, layout = _scan_dim(ctx), targets[0]
    axes = scan_axes(layout, dim)
    if not axes:
        return (), 0
    shape, itemsize = ctx.shapes[0], _scan_dtype(ctx).itemsize
    out = [0] * (max(layout.placement.flat_ranks) + 1)
    for r in layout.placement.flat_ranks:
        local = layout.local_shape(shape, r)
        row = math.prod(local[:dim] + local[dim + 1:])
        out[r] = sum(layout.placement.shape[a] - 1 for a in axes) * row * itemsize
    return tuple(out), len(axes)


def scan_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The shard's scan, then the totals of the ranks before it combined in (`SCANS`' comment).

    Integers are exact. Floating point: a rank's values are its local scan plus (or times) the sum
    (product) of the earlier shards' totals, not one device's left-to-right running sum, so they
    differ from one device's by rounding (compare with a tolerance).
    """
    result = func(*args, **kwargs)
    dim = _scan_dim(where.ctx)
    axes = scan_axes(where.in_layouts[0], dim)
    if where.checking or not axes:
        return result
    kind = SCANS[func]
    comm = context.current()
    placement = where.in_layouts[0].placement
    if result.shape[dim]:
        total = result.select(dim, -1)
    else:  # an empty shard (a dim smaller than the mesh) adds nothing
        total = result.new_full(result.shape[:dim] + result.shape[dim + 1:], IDENTITY[kind])
    offset = None
    for a in reversed(axes):  # innermost first: within the outer piece, then the pieces
        group = placement.group(where.rank, a)
        totals = comm.all_gather(total.contiguous(), group)
        before = totals[:group.index(where.rank)]
        if before:
            here = _combine(kind, before)
            offset = here if offset is None else _combine(kind, [here, offset])
        total = _combine(kind, totals)
    if offset is None:
        return result
    offset = offset.unsqueeze(dim)
    if is_inplace(func):
        return result.add_(offset) if kind == "sum" else result.mul_(offset)
    return _combine(kind, [offset, result])


IDENTITY = {"sum": 0, "prod": 1, "logsumexp": -math.inf}  # what an empty shard's total adds


def _combine(kind: str, parts: list) -> torch.Tensor:
    """The sum (product, log-sum-exp) of `parts` in order, left to right."""
    out = parts[0]
    for p in parts[1:]:
        out = out + p if kind == "sum" else out * p if kind == "prod" else torch.logaddexp(out, p)
    return out


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


register(list(SCANS), Rule(scan_signatures, kernel=scan_local, kernel_cost=scan_cost))
register([aten.histc.default], Rule(histc_signatures, scalar_key=_histc_range))
