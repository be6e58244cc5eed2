"""View and shape ops: each is a map from input dims to output dims; a split travels along it.

A dim that has no image (the selected dim, or a reshape group whose split
pieces would not line up) can only be taken Broadcast, which the dispatcher
boxes to and counts; a sliced, split or concatenated dim may also keep its
split, each rank receiving the rows its results lack (the recut, below); and a dim split unevenly and
merged with the dims inside it ([G, S, d] S(0) -> [G*S, d], G not a multiple
of the ranks) becomes a ragged split of the rows in units of S, no data moved
(`uneven_merge`; the ragged tensor class builds it, `GlobalTensor.of_kind`). Views are linear, so P passes.
Sizes in the arguments are global; kernels that take sizes get this rank's.
"""
from __future__ import annotations

import math
import zlib
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from ..boxing.boxes import Box, intersect, numel, relative, sizes
from ..layout import Layout, slice_box, split_sizes
from ..runtime import context
from ..runtime.symmetry import rank_specific
from ..sbp import Broadcast, Partial, Split
from .moves import exchange_moved, moved_cost
from .scope import in_named
from .registry import PMAX, PMIN, B, Ctx, ShardSite, P, Rule, S, always, aten, register


def dim_map_rule(dim_map: Callable[[Ctx], dict], local: Callable | None = None) -> Rule:
    def signatures(ctx: Ctx) -> list:
        n_in, n_out = len(ctx.shapes), len(ctx.out_shapes)
        sigs = [((S(d),) * n_in, (S(o),) * n_out) for d, o in dim_map(ctx).items()]
        sigs.append(((P,) * n_in, (P,) * n_out))
        return sigs
    return Rule(signatures, kernel=local, plain_when=None if local is None else always)  # hooks that size views


def _d(d: int, n: int) -> int:
    return d % max(n, 1)


# -- reshape -----------------------------------------------------------------
def reshape_groups(ins: Sequence[int], outs: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Runs of input dims and output dims with equal products (the only places a reshape moves data)."""
    groups, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        gi, gj, pi, pj = [i], [j], ins[i], outs[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(ins):
                gi.append(i); pi *= ins[i]; i += 1
            elif j < len(outs):
                gj.append(j); pj *= outs[j]; j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def reshape_map(ins: Sequence[int], outs: Sequence[int], mesh: Sequence[int]) -> dict:
    """A split of a group's outer input dim carries to its outer output dim when the pieces line up
    for every mesh axis size (pieces times the inner size agree, e.g. [b,s,h] S(2) -> [b,s,nh,hd] S(2))."""
    if 0 in ins or math.prod(ins) != math.prod(outs):
        return {}
    m = {}
    for gi, gj in reshape_groups(ins, outs):
        gi = [k for k in gi if ins[k] != 1] or gi[:1]  # size-1 dims hold no piece of a split
        gj = [k for k in gj if outs[k] != 1] or gj[:1]
        inner_in, inner_out = math.prod(ins[k] for k in gi[1:]), math.prod(outs[k] for k in gj[1:])
        if all([s * inner_in for s in split_sizes(ins[gi[0]], n)] ==
               [s * inner_out for s in split_sizes(outs[gj[0]], n)] for n in set(mesh)):
            m[gi[0]] = gj[0]
    # a split of a size-1 dim puts the whole tensor on the first rank of the axis and nothing elsewhere (a
    # single group over an expert axis, [1, S, d] S(0)): any size-1 dim of the output says the same
    one = next((k for k in range(len(outs)) if outs[k] == 1 and k not in m.values()), None)
    if one is not None:
        m.update({k: one for k in range(len(ins)) if ins[k] == 1 and k not in m})
    return m


def inner_pairs(ins: Sequence[int], outs: Sequence[int]) -> list[tuple[int, int]]:
    """(input dim, output dim) pairs a split may take only in company: an inner dim of a merged group to the
    merged dim ([b, s, h] -> [b*s, h]: S(1) -> S(0)), or a split dim to an inner dim of its pieces.

    Alone on a mesh axis such a split is not one run of the other side's order; it is one when the axes
    cutting before it leave the outer dims one element per rank (a batch split down to one sequence per
    rank, the sequence split after it: [b, s] (S(0), S(1)) -> [b*s] (S(0), S(0))). `reshape_local`
    checks that on every rank when the decision is made.
    """
    if 0 in ins or math.prod(ins) != math.prod(outs):
        return []
    pairs = []
    for gi, gj in reshape_groups(ins, outs):
        gi = [k for k in gi if ins[k] != 1]
        gj = [k for k in gj if outs[k] != 1]
        if len(gi) > 1 and len(gj) == 1:
            pairs += [(k, gj[0]) for k in gi[1:]]
        elif len(gi) == 1 and len(gj) > 1:
            pairs += [(gi[0], k) for k in gj[1:]]
    return pairs


def _run(box: Sequence[tuple[int, int]], dims: Sequence[int], shape: Sequence[int]) -> tuple[int, int] | None:
    """(first element, count) of a box's elements over `dims` in row-major order; None if not one run."""
    start, stride, count, cut = 0, 1, 1, False
    for k in reversed(dims):
        first, n = box[k]
        if cut and n > 1:
            return None
        start, count, stride, cut = start + first * stride, count * n, stride * shape[k], cut or n < shape[k]
    return (start, count) if count else (0, 0)


@lru_cache(maxsize=4096)
def reshape_keeps_order(src: Layout, dst: Layout, ins: tuple, outs: tuple) -> bool:
    """Whether every rank's block of the input, read in order, is its block of the output."""
    if 0 in ins:
        return True
    groups = reshape_groups(ins, outs)
    for r in src.placement.flat_ranks:
        a, b = src.shard(ins, r), dst.shard(outs, r)
        if not all(n for _, n in a) and not all(n for _, n in b):
            continue  # empty on both sides: nothing to keep in order
        for gi, gj in groups:
            run = _run(a, gi, ins)
            if run is None or run != _run(b, gj, outs):
                return False
    return True


def reshape_signatures(ctx: Ctx) -> list:
    ins, outs = ctx.shapes[0], ctx.out_shapes[0]
    pairs = list(reshape_map(ins, outs, ctx.mesh).items()) + inner_pairs(ins, outs)
    n_in = len(ctx.shapes)
    return [((S(d),) * n_in, (S(o),)) for d, o in pairs] + [((P,) * n_in, (P,))]


def reshape_local(func, args, kwargs, where: ShardSite):
    """Local data keeps its order, so reshaping to this rank's output shard shape is the view.

    When a decision is made (`where.checking`) the nd layouts are checked too: a split carried by
    `inner_pairs` is right only in some company, which no single axis' signature can see.
    """
    if where.checking and not reshape_keeps_order(where.in_layouts[0], where.out_layouts[0],
                                                                tuple(where.ctx.shapes[0]),
                                                                tuple(where.ctx.out_shapes[0])):
        raise ValueError("reshape: the split does not keep the elements' order on every rank")
    return args[0].reshape(where.out_shape(0))


def uneven_merge(ins: Sequence[int], outs: Sequence[int], layout: Layout) -> tuple[tuple, int, int, int] | None:
    """(mesh axes, input dim, output dim, unit) where a split the reshape cannot carry balanced is carried
    as a ragged one (`gt.ragged`): no data moves.

    A balanced split of an outer dim merged with the dims inside it ([G, S, d] S(0) -> [G*S, d], G not a
    multiple of the ranks: pieces 2+1 of G are 16+8 rows, not the balanced 12+12) still gives every rank
    one contiguous run of the merged dim: its pieces times the inner size, `unit` rows per element of the
    input dim. That is a ragged split of the output dim with those sizes (on every mesh axis that split the
    input dim, nested as the balanced split was: [G, S, d] (S(0), S(0)) on 2x2 gives each rank one run of
    rows in mesh order). Taken when only the mesh `axes` split the dim and nothing else in its reshape
    group, the dim is the outer one of its group (the dims before it of size 1), the inner sizes divide
    (`unit` whole), and every other axis broadcasts or splits a dim the reshape carries balanced. The
    reverse ([G*S, d] ragged -> [G, S, d]) is `globaltensor/raggedtensor/ops.py`'s, balanced again where the sizes
    are the balanced ones. None: the rule's signatures decide as usual.
    """
    if 0 in ins or math.prod(ins) != math.prod(outs):
        return None
    if any(not isinstance(s, (Split, Broadcast)) for s in layout.sbp):
        return None
    carried = reshape_map(ins, outs, layout.placement.shape)
    cut = {s.dim for s in layout.sbp if isinstance(s, Split) and s.dim not in carried}
    if not cut:  # each axis' pieces line up, but nested cuts may not ([2, 8] (S(0), S(0)) on 2x2: 8+0 rows, not 4+4)
        dst = Layout(layout.placement, tuple(Split(carried[s.dim]) if isinstance(s, Split) else s for s in layout.sbp))
        if reshape_keeps_order(layout, dst, tuple(ins), tuple(outs)):
            return None
        dims = [s.dim for s in layout.sbp if isinstance(s, Split)]
        cut = {d for d in dims if dims.count(d) > 1}
    if len(cut) != 1:
        return None
    (d,) = cut
    axes = tuple(a for a, s in enumerate(layout.sbp) if isinstance(s, Split) and s.dim == d)
    for gi, gj in reshape_groups(ins, outs):
        if d not in gi:
            continue
        at = gi.index(d)
        big = [k for k in gj if outs[k] != 1]
        if any(ins[k] != 1 for k in gi[:at]) or not big:
            return None
        if any(isinstance(s, Split) and s.dim in gi and s.dim != d for s in layout.sbp):
            return None
        o = big[0]
        inner_in, inner_out = math.prod(ins[k] for k in gi[at + 1:]), math.prod(outs[k] for k in gj[gj.index(o) + 1:])
        if inner_in % inner_out:
            return None
        return axes, d, o, inner_in // inner_out
    return None


def _uneven_merge_when(ctx: Ctx, srcs: tuple) -> bool:
    return uneven_merge(ctx.shapes[0], ctx.out_shapes[0], srcs[0]) is not None


def _ragged_view(func, args, kwargs):
    """An uneven merge makes a ragged tensor: built by the class that holds ragged layouts, found from the
    tensor's own class (`GlobalTensor.of_kind`), which a floor below cannot import."""
    return type(args[0]).of_kind("ragged").merged_view(func, args, kwargs)
RESHAPE = Rule(reshape_signatures, kernel=reshape_local, decompose=_ragged_view, decompose_when=_uneven_merge_when,
               plain_when=always)
register([aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default,
          aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
          aten.flatten.using_ints, aten.view_as.default], RESHAPE)


# -- pure permutations of dims -------------------------------------------------
def transpose_map(c: Ctx) -> dict:
    n = len(c.shapes[0])
    if c.func == aten.t.default:
        perm = list(range(n))[::-1]
    elif c.func == aten.permute.default:
        perm = [_d(d, n) for d in c.arg(1, "dims")]
    else:
        perm = list(range(n))
        a, b = _d(c.arg(1, "dim0"), n), _d(c.arg(2, "dim1"), n)
        perm[a], perm[b] = perm[b], perm[a]
    return {src: dst for dst, src in enumerate(perm)}


register([aten.t.default, aten.transpose.int, aten.permute.default], dim_map_rule(transpose_map))


def expand_map(c: Ctx) -> dict:
    ins, outs = c.shapes[0], c.out_shapes[0]
    off = len(outs) - len(ins)
    return {d: d + off for d in range(len(ins)) if ins[d] == outs[d + off]}


register([aten.expand.default], dim_map_rule(expand_map, lambda f, a, k, w: a[0].expand(w.out_shape(0))))


# -- ops that cut or join along one dim -----------------------------------------
def all_but(dim_arg: int, name: str, drop: bool = False, insert: bool = False) -> Callable[[Ctx], dict]:
    """Every dim except `dim` keeps its split; `drop` removes dim (select), `insert` adds one (stack)."""
    def m(c: Ctx) -> dict:
        n = len(c.shapes[0])
        dim = c.arg(dim_arg, name, 0)
        if insert:
            dim = _d(dim, n + 1)
            return {d: d + (d >= dim) for d in range(n)}
        dim = _d(dim, n)
        return {d: d - (drop and d > dim) for d in range(n) if d != dim}
    return m


def _dim_of(c: Ctx) -> int:
    """Position of the op's `dim` argument in its schema."""
    return next(i for i, a in enumerate(c.func._schema.arguments) if a.name == "dim")


def keep_others(drop: bool = False, insert: bool = False) -> Callable[[Ctx], dict]:
    def m(c: Ctx) -> dict:
        return all_but(_dim_of(c), "dim", drop, insert)(c)
    return m


def cat_signatures(ctx: Ctx) -> list:
    """Every dim but the joined one keeps its split; all Partial adds up. torch.cat skips a 1-D empty
    tensor among tensors of more dims (the `torch.tensor([])` a KV cache starts from: transformers'
    DynamicCache): it is Broadcast in every signature (nothing to hold), and the joined dim is read
    off the output, so the others keep their splits (they were made Partial to fit it, and reduced)."""
    n = len(ctx.out_shapes[0])
    skipped = [s == (0,) and n > 1 for s in ctx.shapes]
    dim = _d(ctx.arg(1, "dim", 0), n)
    sigs = [(tuple(B if k else S(d) for k in skipped), (S(d),)) for d in range(n) if d != dim]
    sigs.append((tuple(B if k else P for k in skipped), (P,)))
    return sigs


register([aten.select.int, aten.unbind.int], dim_map_rule(keep_others(drop=True)))
register([aten.stack.default], dim_map_rule(keep_others(insert=True)))


def backward_map(insert: bool) -> Callable[[Ctx], dict]:
    """slice_backward/select_backward: the grad's dims land in the input's shape (select adds `dim` back)."""
    def m(c: Ctx) -> dict:
        n_out = len(c.out_shapes[0])
        dim = _d(c.arg(2, "dim"), n_out)
        if insert:
            return {d: d + (d >= dim) for d in range(n_out - 1)}
        return {d: d for d in range(n_out) if d != dim}
    return m


def sized_backward(func, args, kwargs, where: ShardSite):
    return func(args[0], list(where.out_shape(0)), *args[2:], **kwargs)


register([aten.select_backward.default], dim_map_rule(backward_map(True), sized_backward))


# -- padding and flipping ------------------------------------------------------------------------
def _pad_value(args: tuple, kwargs: dict):
    return args[2] if len(args) > 2 else kwargs.get("value", 0)


def pad_signatures(ctx: Ctx) -> list:
    """Every split passes. A split padded (or, with negative pads, cut) dim stays that split: its rows shift
    by the pad before them, each rank receiving the rows that land in its block from the ranks holding them
    (`ops/moves.py`, as a slice's), the rest the fill. Padding is linear when the fill is 0 (P passes); max
    and min of a fill every rank writes is that fill."""
    sigs = [((S(d),), (S(d),)) for d in range(len(ctx.shapes[0]))]
    if _pad_value(ctx.args, ctx.kwargs) == 0:
        sigs.append(((P,), (P,)))
    return sigs + [((PMAX,), (PMAX,)), ((PMIN,), (PMIN,))]


def _pads(ctx: Ctx) -> dict:
    """dim -> (before, after) for each dim constant_pad_nd pads or cuts."""
    pad, n = list(ctx.arg(1, "pad")), len(ctx.shapes[0])
    return {n - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}


def _pad_moves(ctx: Ctx, layout: Layout) -> tuple:
    """(dim, "shift", before) for each padded dim some mesh axis splits."""
    split = {s.dim for s in layout.sbp if isinstance(s, Split)}
    return tuple((d, "shift", before) for d, (before, _) in sorted(_pads(ctx).items()) if d in split)


def pad_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The shard padded along its whole padded dims, then its rows shifted into place along the split ones."""
    ctx, layout = where.ctx, where.in_layouts[0]
    moves = _pad_moves(ctx, layout)
    if not moves:
        return func(*args, **kwargs)
    moved = {d for d, _, _ in moves}
    pads, n, value = _pads(ctx), len(ctx.shapes[0]), _pad_value(args, kwargs)
    here = [0] * (2 * max((n - d for d in pads), default=0))
    for d, (before, after) in pads.items():
        if d not in moved:
            here[2 * (n - 1 - d)], here[2 * (n - 1 - d) + 1] = before, after
    x = func(args[0], here, value) if any(here) else args[0]
    out = x.new_full(where.out_shape(0), value)
    if where.checking:
        return out
    in_shape = tuple(ctx.shapes[0][d] if d in moved or d not in pads else ctx.out_shapes[0][d] for d in range(n))
    return exchange_moved(x, out, layout, in_shape, where.out_layouts[0], tuple(ctx.out_shapes[0]), moves, where.rank)


def pad_cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> tuple:
    moves = _pad_moves(ctx, targets[0])
    if not moves:
        return (), 0
    moved, pads, n = {d for d, _, _ in moves}, _pads(ctx), len(ctx.shapes[0])
    in_shape = tuple(ctx.shapes[0][d] if d in moved or d not in pads else ctx.out_shapes[0][d] for d in range(n))
    return moved_cost(targets[0], in_shape, out_layouts[0], tuple(ctx.out_shapes[0]), moves,
                      ctx.args[0].dtype.itemsize)


def flip_signatures(ctx: Ctx) -> list:
    """Every split passes. A split of a dim that is not flipped holds the same rows flipped: nothing
    moves. A split of a flipped dim stays that split: each rank flips its shard, which is then the
    rows of the result at the mirror image of its place, and the ranks exchange those rows
    (`flip_local`, charged by `flip_cost`: each rank receives exactly what it lacks); where a
    conversion first costs less (an all-to-all to another dim's split), the dispatcher takes that.
    A flip only moves elements, so every Partial passes."""
    return [((S(d),), (S(d),)) for d in range(len(ctx.shapes[0]))] + [((p,), (p,)) for p in (P, PMAX, PMIN)]


def _flipped(ctx: Ctx) -> frozenset:
    n = len(ctx.shapes[0])
    return frozenset(_d(d, n) for d in ctx.arg(1, "dims"))


def _mirror(box: Box, shape: tuple, flipped: frozenset) -> Box:
    """Where `box` lands in the flipped tensor."""
    return tuple((n - start - size, size) if d in flipped else (start, size)
                 for d, ((start, size), n) in enumerate(zip(box, shape)))


@lru_cache(maxsize=4096)
def flip_takes(layout: Layout, shape: tuple, flipped: frozenset, rank: int) -> tuple:
    """What `rank` gathers for its shard of the flipped tensor: (peer, box in global coordinates) per
    peer whose flipped shard overlaps it, `rank` itself included. Its peers are the ranks that differ
    from it only on mesh axes splitting a flipped dim: on every other axis (B, P, a split of another
    dim) they hold the same rows, or the same Partial term, as it does."""
    pl = layout.placement
    axes = {a for a, s in enumerate(layout.sbp) if isinstance(s, Split) and s.dim in flipped}
    here, mine = pl.coord(rank), layout.shard(shape, rank)
    takes = []
    for q in pl.flat_ranks:
        if all(a in axes or x == y for a, (x, y) in enumerate(zip(pl.coord(q), here))):
            piece = intersect(mine, _mirror(layout.shard(shape, q), shape, flipped))
            if numel(piece):
                takes.append((q, piece))
    return tuple(takes)


_FLIP_KEY = zlib.crc32(b"flip")  # its messages' key (`Communicator.exchange`), the same in every process


def flip_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The shard flipped, then exchanged with the mirror ranks (`flip_takes`) where a flipped dim is split."""
    out = func(*args, **kwargs)
    layout, shape, flipped, rank = where.in_layouts[0], where.ctx.shapes[0], _flipped(where.ctx), where.rank
    if where.checking or not any(isinstance(s, Split) and s.dim in flipped for s in layout.sbp):
        return out
    rank_specific("a flip of a split dim (mirror ranks swap rows)")
    mine = layout.shard(shape, rank)      # its shard of the input, and of the result (the same layout)
    held = _mirror(mine, shape, flipped)  # the rows of the result this rank's flipped shard holds
    result, sends, recvs, places = torch.empty_like(out), {}, {}, {}
    for q, piece in flip_takes(layout, shape, flipped, rank):
        if q == rank:
            slice_box(result, relative(piece, mine)).copy_(slice_box(out, relative(piece, held)))
        else:
            recvs[q], places[q] = (sizes(piece), out.dtype), relative(piece, mine)
    for q in layout.placement.flat_ranks:
        if q != rank:
            given = [b for p, b in flip_takes(layout, shape, flipped, q) if p == rank]
            if given:
                sends[q] = slice_box(out, relative(given[0], held))
    if sends or recvs:
        for q, got in context.current().exchange(sends, recvs, device=out.device, key=_FLIP_KEY).items():
            slice_box(result, places[q]).copy_(got)
    return result


def flip_cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> tuple:
    """What `flip_local` receives per global rank, and its latency terms: as a point-to-point
    conversion's (`boxing/exchange.py`), the most peers a rank receives from or sends to."""
    layout, shape, flipped = targets[0], ctx.shapes[0], _flipped(ctx)
    ranks = layout.placement.flat_ranks
    recv, hears, tells = [0] * (max(ranks) + 1), dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
    for r in ranks:
        for q, piece in flip_takes(layout, shape, flipped, r):
            if q != r:
                recv[r] += numel(piece) * ctx.args[0].dtype.itemsize
                hears[r] += 1  # peers r receives from
                tells[q] += 1  # peers q sends to
    if not any(recv):
        return (), 0
    return tuple(recv), max(max(hears.values()), max(tells.values()))


register([aten.constant_pad_nd.default],
         Rule(pad_signatures, kernel=pad_local, kernel_cost=pad_cost,
              plain_when=lambda ctx, ins, outs: not _pad_moves(ctx, ins[0]),
              scalar_key=lambda args, kwargs: _pad_value(args, kwargs) == 0))
def _flips_no_split(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    """`flip_local` is the plain flip where no flipped dim is split (no mirror exchange: `Rule.plain_when`)."""
    flipped = _flipped(ctx)
    return not any(isinstance(s, Split) and s.dim in flipped for s in ins[0].sbp)


register([aten.flip.default],
         Rule(flip_signatures, kernel=flip_local, kernel_cost=flip_cost, plain_when=_flips_no_split))


# -- recut: a cut or a join along a split dim, each rank receiving exactly the rows it lacks -------------------
# A slice, split or narrow of a dim that is split, the cat that joins pieces along it (split's backward) and
# slice_backward (a slice's) lay their results out by the same split: each result's rows balanced over the ranks
# that split the dim, as a split of that result alone would place them. The rows a rank's result holds sit in
# the inputs' shards of its peers (the ranks that differ from it only on the mesh axes splitting that dim), so
# it receives just those, point-to-point, in one message per peer; a row no input covers (slice_backward's
# padding) is zero. Without it a cut of a split dim is taken Partial (each rank its rows, zeros elsewhere) and
# reduced wherever a nonlinear op reads it: the packed gate and up projections of a gated MLP split on their
# packed dim (transformers' `gate_up.chunk(2, -1)`) then cost two reduce-scatters of the whole activation, where
# this moves what a rank lacks, the half of its rows that sits elsewhere on 2 ranks.
def _start(n: int, start: Any) -> int:
    """A slice's or narrow's start as torch reads it: None is 0, a negative one counts from the end, clamped."""
    start = 0 if start is None else start + n if start < 0 else start
    return min(max(start, 0), n)


def recut_lines(c: Ctx) -> tuple[int, tuple, tuple] | None:
    """(dim, each input's offset, each output's offset) along the cut or joined dim, in one line's coordinates
    where the inputs' rows and the results' rows sit; None where the op is not a contiguous cut (a step)."""
    f = c.func
    if f in (aten.slice.Tensor, aten.narrow.default, aten.slice_backward.default):
        backward = f is aten.slice_backward.default
        n_in = len(c.out_shapes[0] if backward else c.shapes[0])
        dim = _d(c.arg(2 if backward else 1, "dim", 0), n_in)
        n = (c.out_shapes[0] if backward else c.shapes[0])[dim]
        if f is aten.narrow.default:
            start = _start(n, c.arg(2, "start"))
        else:
            if c.arg(5 if backward else 4, "step", 1) != 1:
                return None
            start = _start(n, c.arg(3 if backward else 2, "start", None))
        return (dim, (start,), (0,)) if backward else (dim, (0,), (start,))
    if f in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = _d(c.arg(2, "dim", 0), len(c.shapes[0]))
        offsets, at = [], 0
        for shape in c.out_shapes:
            offsets.append(at)
            at += shape[dim]
        return dim, (0,), tuple(offsets)
    if f is aten.cat.default:
        n = len(c.out_shapes[0])
        if any(s == (0,) and n > 1 for s in c.shapes):
            return None
        dim = _d(c.arg(1, "dim", 0), n)
        offsets, at = [], 0
        for shape in c.shapes:
            offsets.append(at)
            at += shape[dim]
        return dim, tuple(offsets), (0,)
    return None


def recut_signatures(c: Ctx) -> list:
    """The cut or joined dim split alike on every input and result (`recut_local` moves the rows)."""
    lines = recut_lines(c)
    if lines is None:
        return []
    dim = lines[0]
    return [((S(dim),) * len(c.shapes), (S(dim),) * len(c.out_shapes))]


def _cuts_split(c: Ctx, ins: tuple) -> bool:
    lines = recut_lines(c)
    return lines is not None and any(isinstance(s, Split) and s.dim == lines[0] for s in ins[0].sbp)


@lru_cache(maxsize=4096)
def recut_plan(ins: tuple, outs: tuple, dim: int) -> dict:
    """{rank: [(peer, output j, input i, piece)]}: the rows of each result `rank` takes from each peer's input,
    as a box in the line's coordinates (`ins`, `outs`: (layout, shape, offset) per tensor)."""
    def on_line(layout: Layout, shape: tuple, offset: int, rank: int) -> Box:
        box = layout.shard(shape, rank)
        return tuple((s + offset, n) if d == dim else (s, n) for d, (s, n) in enumerate(box))

    pl = ins[0][0].placement
    axes = {a for a, s in enumerate(ins[0][0].sbp) if isinstance(s, Split) and s.dim == dim}
    plan = {}
    for r in pl.flat_ranks:
        here, takes = pl.coord(r), []
        for j, (lay_o, shape_o, off_o) in enumerate(outs):
            mine = on_line(lay_o, shape_o, off_o, r)
            for q in pl.flat_ranks:
                if all(a in axes or x == y for a, (x, y) in enumerate(zip(pl.coord(q), here))):
                    for i, (lay_i, shape_i, off_i) in enumerate(ins):
                        piece = intersect(mine, on_line(lay_i, shape_i, off_i, q))
                        if numel(piece):
                            takes.append((q, j, i, piece))
        plan[r] = takes
    return plan


_RECUT_KEY = zlib.crc32(b"recut")  # its messages' key (`Communicator.exchange`), the same in every process


def _recut_inputs(where: ShardSite) -> tuple:
    lines = recut_lines(where.ctx)
    dim, in_off, out_off = lines
    c = where.ctx
    ins = tuple((lay, tuple(shape), off) for lay, shape, off in zip(where.in_layouts, c.shapes, in_off))
    outs = tuple((lay, tuple(shape), off) for lay, shape, off in zip(where.out_layouts, c.out_shapes, out_off))
    return dim, ins, outs


def recut_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """The results' shards gathered from the peers' input shards (`recut_plan`), one message per peer."""
    dim, ins, outs = _recut_inputs(where)
    locals_in = list(args[0]) if func is aten.cat.default else [args[0]]
    like = locals_in[0]
    results = [torch.zeros(where.out_shape(j), dtype=like.dtype, device=like.device) for j in range(len(outs))]
    if not where.checking:
        rank_specific("a recut of split pieces (rows moved between particular ranks)")
        plan, rank = recut_plan(ins, outs, dim), where.rank

        def mine_of(j: int, r: int) -> Box:
            lay, shape, off = outs[j]
            return tuple((s + off, n) if d == dim else (s, n) for d, (s, n) in enumerate(lay.shard(shape, r)))

        def held_of(i: int, r: int) -> Box:
            lay, shape, off = ins[i]
            return tuple((s + off, n) if d == dim else (s, n) for d, (s, n) in enumerate(lay.shard(shape, r)))

        sends: dict = {}
        for q in plan:
            if q != rank:
                given = [slice_box(locals_in[i], relative(piece, held_of(i, rank)))
                         for p, j, i, piece in plan[q] if p == rank]
                if given:
                    sends[q] = torch.cat([g.reshape(-1) for g in given])
        recvs, places = {}, {}
        for q, j, i, piece in plan[rank]:
            if q == rank:
                slice_box(results[j], relative(piece, mine_of(j, rank))).copy_(
                    slice_box(locals_in[i], relative(piece, held_of(i, rank))))
            else:
                places.setdefault(q, []).append((j, piece))
        for q, pieces in places.items():
            recvs[q] = ((sum(numel(p) for _, p in pieces),), like.dtype)
        if sends or recvs:
            for q, got in context.current().exchange(sends, recvs, device=like.device, key=_RECUT_KEY).items():
                at = 0
                for j, piece in places[q]:
                    k = numel(piece)
                    slice_box(results[j], relative(piece, mine_of(j, rank))).copy_(got[at:at + k].view(sizes(piece)))
                    at += k
    if func in (aten.split.Tensor, aten.split_with_sizes.default):
        return results
    return results[0]


def recut_cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> tuple:
    """What `recut_local` receives per global rank, and its latency terms (the most peers a rank receives from
    or sends to), as `flip_cost` counts them; nothing where the dim is not split."""
    lines = recut_lines(ctx)
    if lines is not None and in_named() and any(
            isinstance(s, Split) and s.dim == lines[0] and isinstance(t, Partial)
            for src, dst in zip(sources, targets) for s, t in zip(src.sbp, dst.sbp)):
        # Partial is free inside a module whose boundary the user laid out (`ops/scope.py`): Megatron's
        # row-parallel product, reduced at the boundary. A cut of a split dim taken Partial (each rank its rows,
        # zeros elsewhere) is not that: the op reading it pays a reduction of the whole where the recut moves
        # only what each rank lacks, so the choice is not offered there
        return None
    if lines is None or not any(isinstance(s, Split) and s.dim == lines[0] for s in targets[0].sbp):
        return (), 0
    dim, in_off, out_off = lines
    ins = tuple((lay, tuple(shape), off) for lay, shape, off in zip(targets, ctx.shapes, in_off))
    outs = tuple((lay, tuple(shape), off) for lay, shape, off in zip(out_layouts, ctx.out_shapes, out_off))
    first = ctx.args[0][0] if isinstance(ctx.args[0], (list, tuple)) else ctx.args[0]
    plan, ranks = recut_plan(ins, outs, dim), targets[0].placement.flat_ranks
    recv, hears, tells = [0] * (max(ranks) + 1), dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
    for r in ranks:
        peers = {q for q, *_ in plan[r] if q != r}
        recv[r] = sum(numel(piece) for q, _, _, piece in plan[r] if q != r) * first.dtype.itemsize
        hears[r] += len(peers)
        for q in peers:
            tells[q] += 1
    if not any(recv):
        return (), 0
    return tuple(recv), max(max(hears.values()), max(tells.values()))


def recutting(base: Rule) -> Rule:
    """`base` with the recut signature: its kernel where the cut dim is split, `base`'s (or the op) elsewhere."""
    def signatures(c: Ctx) -> list:
        return list(base.signatures(c)) + recut_signatures(c)

    def kernel(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
        if _cuts_split(where.ctx, where.in_layouts):
            return recut_local(func, args, kwargs, where)
        return func(*args, **kwargs) if base.kernel is None else base.kernel(func, args, kwargs, where)

    def plain_when(c: Ctx, ins: tuple, outs: tuple) -> bool:
        return not _cuts_split(c, ins) and (base.kernel is None or base.plain_when is not None
                                            and base.plain_when(c, ins, outs))

    def unaliased(c: Ctx, ins: tuple, outs: tuple) -> bool:  # a recut's results are new memory, not views
        return _cuts_split(c, ins)

    return Rule(signatures, kernel=kernel, kernel_cost=recut_cost, plain_when=plain_when, unaliased=unaliased)


register([aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.narrow.default],
         recutting(dim_map_rule(keep_others())))
register([aten.cat.default], recutting(Rule(cat_signatures)))
register([aten.slice_backward.default], recutting(dim_map_rule(backward_map(False), sized_backward)))
