"""Reductions: a split reduced dim leaves each rank a partial result (P for sum/mean, P(max)/P(min))."""
from __future__ import annotations

import math
from typing import Any

import torch

from ..runtime import context
from ..sbp import Broadcast, Split
from .arguments import named_args
from .dims import carried
from .pointwise import split_signatures
from .registry import B, P, PMAX, PMIN, S, Ctx, Rule, ShardSite, aten, is_inplace, no_signatures, register


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


# -- prod, logsumexp, nansum, aminmax, the `norm` overloads, dist, renorm, segment_reduce ----------------------
#
# Kept dims split pass through every one of them. A split reduced dim:
# - nansum: each rank's sum of its non-NaN elements is a term (P); a P input does not pass (a NaN in one
#   rank's term is not a NaN of the sum).
# - aminmax: each rank's min and max are P(min), P(max) (an empty shard gives the identities).
# - prod, logsumexp: no Partial of theirs exists, so the kernel reduces its shard, all-gathers the
#   ranks' results over each mesh axis that splits a reduced dim and combines them (product; logsumexp
#   of the pieces' logsumexps): a [kept dims]-sized exchange, never the input. Charged by
#   `combined_cost`. Integers' products wrap alike in any order; floats differ from one device by rounding.
# - norm, dist: decomposed into `linalg_vector_norm` (what torch computes them as), whose rule
#   (`ops/norm.py`) reduces the powered sums; renorm into that norm over every dim but `dim`, its scale
#   factor, and a product, when a dim other than `dim` is split (the norms must then be reduced).
def _kept(d: int, dims: list, keep: bool) -> int:
    """The output dim of kept input dim `d`."""
    return d if keep else d - sum(r < d for r in dims)


def reduce_signatures(reduced, partial_input: bool = False):
    """Kept dims carried; a split reduced dim gives `reduced` (one SBP per output; None: not allowed)."""
    def signatures(ctx: Ctx) -> list:
        dims, keep = reduced_dims(ctx)
        n_out = len(ctx.out_shapes)
        sigs = []
        for d in range(len(ctx.shapes[0])):
            if d not in dims:
                sigs.append(((S(d),), (S(_kept(d, dims, keep)),) * n_out))
            elif reduced is not None:
                sigs.append(((S(d),), tuple(reduced)))
        return sigs
    return signatures


# -- nansum, aminmax -----------------------------------------------------------------------------------
register([aten.nansum.default], Rule(reduce_signatures((P,))))


def _identity(dtype: torch.dtype, kind: str) -> Any:
    """min's identity (the largest value) or max's (the smallest) of `dtype`."""
    if dtype == torch.bool:
        return kind == "min"
    if dtype.is_floating_point:
        return math.inf if kind == "min" else -math.inf
    info = torch.iinfo(dtype)
    return info.max if kind == "min" else info.min


def aminmax_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> tuple:
    """torch refuses an empty reduced dim (no identity); a rank whose shard of a split reduced dim is
    empty gives the identities, which P(min)/P(max) ignore."""
    x = args[0]
    dims, _ = reduced_dims(where.ctx)
    if not any(x.shape[d] == 0 and where.ctx.shapes[0][d] for d in dims if d < x.dim()):
        return func(*args, **kwargs)
    return (x.new_full(where.out_shape(0), _identity(x.dtype, "min")),
            x.new_full(where.out_shape(1), _identity(x.dtype, "max")))


register([aten.aminmax.default], Rule(reduce_signatures((PMIN, PMAX)), kernel=aminmax_local))


# -- prod, logsumexp: the ranks' results gathered and combined -------------------------------------------
COMBINE = {aten.prod.default: "prod", aten.prod.dim_int: "prod", aten.logsumexp.default: "logsumexp"}


def _combine_axes(ctx: Ctx, layout: Any) -> tuple:
    """The mesh axes (of more than one rank) that split a reduced dim."""
    dims, _ = reduced_dims(ctx)
    return tuple(a for a, s in enumerate(layout.sbp)
                 if isinstance(s, Split) and s.dim in dims and layout.placement.shape[a] > 1)


def combined_cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> tuple:
    """On each mesh axis a that splits a reduced dim, every rank receives the other n_a - 1 results
    (its output shard's size), one all-gather per axis."""
    axes = _combine_axes(ctx, targets[0])
    if not axes:
        return (), 0
    out, lay = out_layouts[0], targets[0]
    itemsize = ctx.func(*ctx.args, **ctx.kwargs).dtype.itemsize  # meta stand-ins: the result's dtype
    per = [0] * (max(lay.placement.flat_ranks) + 1)
    for r in lay.placement.flat_ranks:
        numel = math.prod(out.local_shape(ctx.out_shapes[0], r))
        per[r] = sum(lay.placement.shape[a] - 1 for a in axes) * numel * itemsize
    return tuple(per), len(axes)


def combined_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The shard's reduction, then the other ranks' (over each splitting mesh axis in turn) combined in.

    An empty shard's prod is 1 and its logsumexp -inf, the identities, as torch gives them."""
    result = func(*args, **kwargs)
    axes = _combine_axes(where.ctx, where.in_layouts[0])
    if where.checking or not axes:
        return result
    comm = context.current()
    placement = where.in_layouts[0].placement
    for a in axes:
        parts = comm.all_gather(result.contiguous(), placement.group(where.rank, a))
        if COMBINE[func] == "prod":
            result = parts[0]
            for p in parts[1:]:
                result = result * p
        else:
            result = torch.logsumexp(torch.stack(parts), 0)
    return result


def combined_signatures(ctx: Ctx) -> list:
    """Kept dims carried; a split reduced dim -> Broadcast, the kernel exchanging the results."""
    return reduce_signatures((B,))(ctx)


register(list(COMBINE), Rule(combined_signatures, kernel=combined_local, kernel_cost=combined_cost))


# -- norm, dist: torch computes both as linalg_vector_norm ------------------------------------------------
def norm_as_vector_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """`norm(x, p, dim, keepdim, dtype)` is `linalg_vector_norm(x, p or 2, dim, keepdim, dtype)` in torch
    (ATen's impl_func_norm); `norm.Scalar` reduces every dim."""
    named = named_args(func, args, kwargs)
    p = 2 if named.get("p") is None else named["p"]
    return aten.linalg_vector_norm.default(args[0], p, named.get("dim"), bool(named.get("keepdim", False)),
                                           dtype=named.get("dtype"))


def dist_as_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """`dist(a, b, p)` is `norm(a - b, p)` in torch."""
    named = named_args(func, args, kwargs)
    return aten.linalg_vector_norm.default(aten.sub.Tensor(args[0], args[1]), named.get("p", 2))


register([getattr(aten.norm, o) for o in ("Scalar", "ScalarOpt_dim", "ScalarOpt_dim_dtype", "ScalarOpt_dtype")],
         Rule(no_signatures, decompose=norm_as_vector_norm))
register([aten.dist.default], Rule(no_signatures, decompose=dist_as_norm))


# -- renorm: each slice along `dim` scaled by its own norm ----------------------------------------------------
def _renorm_dim(ctx: Ctx) -> int:
    return ctx.arg(2, "dim") % max(len(ctx.shapes[0]), 1)


def renorm_signatures(ctx: Ctx) -> list:
    """A split of `dim` holds whole slices: each rank renorms its own."""
    d = _renorm_dim(ctx)
    return [((S(d),), (S(d),))] if ctx.shapes[0] else []


def _renorm_spread(ctx: Ctx, layouts: tuple) -> bool:
    """Some other dim split (or a Partial): the slices' norms need reducing. float32/float64 only, where
    torch's norm is of the input's own dtype (half takes float norms: left to the rule's own signatures)."""
    d = _renorm_dim(ctx) if ctx.shapes[0] else None
    return ctx.args[0].dtype in (torch.float32, torch.float64) and \
        any(not isinstance(s, Broadcast) and s != S(d) for s in layouts[0].sbp)


def renorm_spread(func: Any, args: tuple, kwargs: dict) -> Any:
    """torch's renorm: the norm over every dim but `dim` (kept), the factor maxnorm / (norm + 1e-7) where
    the norm exceeds maxnorm (else 1), times the input."""
    named = named_args(func, args, kwargs)
    x, p, maxnorm = args[0], named["p"], named["maxnorm"]
    d = named["dim"] % x.dim()
    norm = aten.linalg_vector_norm.default(x, p, [k for k in range(x.dim()) if k != d], True)
    scaled = aten.div.Tensor(aten.full_like.default(norm, maxnorm), aten.add.Scalar(norm, 1e-7))
    factor = aten.where.self(aten.gt.Scalar(norm, maxnorm), scaled, aten.ones_like.default(norm))
    return (aten.mul_.Tensor if func == aten.renorm_.default else aten.mul.Tensor)(x, factor)


register([aten.renorm.default, aten.renorm_.default],
         Rule(renorm_signatures, decompose=renorm_spread, decompose_when=_renorm_spread))


# isclose is elementwise; torch's Python API decomposes it before dispatch (allclose: ops/structural.py)
register([aten.isclose.default], Rule(split_signatures))


# -- segment_reduce: segments run along `axis`; every other dim is carried ------------------------------------
def _segment_dims(first_data: int, n_tensors: int):
    """`segment_reduce(data, ...)` / `_segment_reduce_backward(grad, output, data, ...)`: the tensors before
    and at `first_data` (data-shaped but along `axis`) split alike on any dim but `axis`; lengths and
    offsets whole."""
    def dims(ctx: Ctx) -> list:
        axis = ctx.named("axis") % max(len(ctx.out_shapes[0]), 1)
        return [(tuple(d if i <= first_data else None for i in range(n_tensors(ctx))), (d,))
                for d in range(len(ctx.out_shapes[0])) if d != axis]
    return dims


register([aten.segment_reduce.default], carried(_segment_dims(0, lambda ctx: len(ctx.shapes))))
register([aten._segment_reduce_backward.default], carried(_segment_dims(2, lambda ctx: len(ctx.shapes))))
