"""Structural ops: triangles and diagonals, roll/rot90/repeat/unfold, scatters into slices, diagonals and
masks, take/put, writes along a dim, searches, histograms, and a few that read everything.

Most of them leave some dims alone (the batch dims of `tril`, the dims `roll` does not roll): a split
there passes with nothing moved. The matrix dims of the triangle and diagonal ops may be split too, with
a kernel told where its block sits (`ShardSite`): a block at rows r0, columns c0 holds global element
(r0 + i, c0 + j), so the global diagonal `offset` is the local diagonal `offset + r0 - c0`. `tril_` of a
block is then `tril_` with that offset, exactly; the diagonal of a block is a run of the global diagonal:
`diagonal_copy` returns it placed in zeros of the full length, a Partial sum over the ranks that cut the
matrix (every entry sits in one block), the view `diagonal` only where that run is the rank's balanced
part (so that it stays a view), and the writing ops (`diag_embed`, `diagonal_backward`,
`diagonal_scatter`) write from a whole source into their block only. Ops that only move values are
linear, so Partial (sum) passes through them.

A view's result is a view of the shard it ran on; where its input had to be converted first, that is a
copy, and a write through the view would not reach the input. The rules here avoid giving a new layout
to results that torch itself views and writes through next (see `tri_signatures`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from ..layout import Layout
from ..runtime import context
from ..sbp import Broadcast, Partial, Split
from .datadependent import whole
from .indexing import _indexing, write_along_dim
from .moves import exchange_moved, moved_cost
from .reduction import reduction
from .registry import B, Ctx, P, Rule, S, ShardSite, aten, is_inplace, no_signatures, pointwise_dims, register


def _n(ctx: Ctx, i: int = 0) -> int:
    return len(ctx.shapes[i])


def _held_whole(where: ShardSite, i: int, dims: tuple) -> bool:
    box, shape = where.in_box(i), where.ctx.shapes[i]
    return all(box[d][1] == shape[d] for d in dims)


def _local_diagonal(offset: int, rows: tuple, cols: tuple) -> tuple[int, int, int]:
    """(local offset, global index of the block's first diagonal entry, count of them) for a block whose
    rows and columns are (start, size) of the matrix: global diagonal entry i sits at row i + max(0, -offset),
    column i + max(0, offset)."""
    (r0, nr), (c0, nc) = rows, cols
    lo = offset + r0 - c0
    count = max(0, min(nr - max(0, -lo), nc - max(0, lo)))
    return lo, r0 + max(0, -lo) - max(0, -offset), count


# -- tril / triu -----------------------------------------------------------------------------------
def tri_signatures(ctx: Ctx) -> list:
    """Batch dims pass. In place (tril_), a split matrix dim passes too, by `tri_local`'s offset, and P (zeroing
    entries is linear).

    The out-of-place op keeps its matrix dims whole, though the offset kernel computes it as exactly: its
    result is often viewed and written through next (`tril(-1).diagonal().fill_(1)` in torch's own
    householder_product gradient), and a view whose input must first be converted (the diagonal of a
    non-square row split, or of a Partial) is a view of the converted copy, so the write would be lost (a
    conversion does not keep aliases, ops/program.py). Whole matrix dims keep the diagonal a view. In place,
    the target keeps the layout it had: no new layout for a later view to convert."""
    n = _n(ctx)
    if not is_inplace(ctx.func):
        return [((S(d),), (S(d),)) for d in range(n - 2)]
    return [((S(d),), (S(d),)) for d in range(n)] + [((P,), (P,))]


def tri_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The block's triangle is the one whose diagonal is moved by where the block sits."""
    n = _n(where.ctx)
    box = where.in_box(0)
    shift = box[n - 2][0] - box[n - 1][0]
    return func(args[0], where.ctx.named("diagonal", 0) + shift)


def _matrix_dims_whole(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    n = _n(ctx)
    return not any(isinstance(s, Split) and s.dim >= n - 2 for s in ins[0].sbp)


register([aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default],
         Rule(tri_signatures, kernel=tri_local, plain_when=_matrix_dims_whole))


# -- diagonal and its inverses ---------------------------------------------------------------------
def _diag_args(ctx: Ctx, n: int, d1: str = "dim1", d2: str = "dim2", defaults: tuple = (0, 1)) -> tuple:
    return (ctx.named("offset", 0), ctx.named(d1, defaults[0]) % n, ctx.named(d2, defaults[1]) % n)


def diagonal_signatures(ctx: Ctx) -> list:
    """Batch dims pass (to their place among the output's leading dims); a view of the shard: P passes.

    A split matrix dim passes to the diagonal where each rank's block holds exactly its balanced part of the
    diagonal (rows split with offset >= 0 and as many diagonal entries as rows, or columns alike with
    offset <= 0: a square matrix's main diagonal): the shard's own diagonal at the shifted offset, still a
    view of the shard, so writes through it (`x.diagonal().fill_(1)`) land. `diagonal_copy`, which nothing
    writes through, also takes any split matrix dim, the diagonal then Partial (`diagonal_local`). A mesh axis
    splitting the diagonal and another giving a Partial of it must not cut the same matrix dim (nested cuts:
    the first axis' pieces are not the diagonal's), nor two axes split the diagonal from both matrix dims;
    `diagonal_local` refuses those."""
    n = _n(ctx)
    offset, d1, d2 = _diag_args(ctx, n)
    rest = [d for d in range(n) if d not in (d1, d2)]
    sigs = [((S(d),), (S(k),)) for k, d in enumerate(rest)] + [((P,), (P,))]
    length = ctx.out_shapes[0][-1]
    if offset >= 0 and length == ctx.shapes[0][d1]:
        sigs.append(((S(d1),), (S(n - 2),)))
    if offset <= 0 and length == ctx.shapes[0][d2]:
        sigs.append(((S(d2),), (S(n - 2),)))
    if ctx.func == aten.diagonal_copy.default:
        sigs += [((S(d1),), (P,)), ((S(d2),), (P,))]
    return sigs


def _block_diagonal(where: ShardSite) -> Optional[tuple]:
    """(n, d1, d2, lo, first, count) of the diagonal in this rank's block of input 0 (`_local_diagonal`);
    None where the block holds both matrix dims whole (the op runs as it is)."""
    n = _n(where.ctx)
    offset, d1, d2 = _diag_args(where.ctx, n)
    if _held_whole(where, 0, (d1, d2)):
        return None
    box = where.in_box(0)
    return (n, d1, d2) + tuple(_local_diagonal(offset, box[d1], box[d2]))


def diagonal_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The diagonal entries of this rank's block: the block's own diagonal where the output is split along it
    (the signatures see to it that those are exactly its part), else placed at their global places in zeros
    of the diagonal's length (a Partial term)."""
    block = _block_diagonal(where)
    if block is None:
        return func(*args, **kwargs)
    n, d1, d2, lo, first, count = block
    ins, outs = where.in_layouts[0].sbp, where.out_layouts[0].sbp
    if where.checking:
        along = {i.dim for i, o in zip(ins, outs) if isinstance(i, Split) and isinstance(o, Split) and o.dim == n - 2}
        summed = {i.dim for i, o in zip(ins, outs) if isinstance(i, Split) and isinstance(o, Partial)}
        if len(along) > 1 or along & summed:
            raise ValueError("diagonal: mesh axes split and sum the same matrix dim")
    if not any(isinstance(s, Partial) for s in outs):
        return func(args[0], lo, d1, d2)
    out = args[0].new_zeros(where.out_shape(0))
    o0, on = where.out_box(0)[-1]
    a, b = max(first, o0), min(first + count, o0 + on)
    if b > a:
        out[..., a - o0:b - o0] = torch.diagonal(args[0], lo, d1, d2)[..., a - first:b - first]
    return out


register([aten.diagonal.default, aten.diagonal_copy.default],
         Rule(diagonal_signatures, kernel=diagonal_local,
              plain_when=lambda ctx, ins, outs: not any(isinstance(s, Split) and s.dim in _diag_args(ctx, _n(ctx))[1:]
                                                        for s in ins[0].sbp)))


def _embed_dims(ctx: Ctx) -> tuple:
    """(offset, dim1, dim2, output rank) of diag_embed / diagonal_backward."""
    if ctx.func == aten.diag_embed.default:
        n = _n(ctx) + 1
        return (*_diag_args(ctx, n, defaults=(-2, -1)), n)
    n = len(ctx.out_shapes[0])
    return ctx.arg(2, "offset"), ctx.arg(3, "dim1") % n, ctx.arg(4, "dim2") % n, n


def embed_signatures(ctx: Ctx) -> list:
    """(diagonal values) -> matrix: batch dims pass; values split along the diagonal give a Partial
    matrix; whole values give a matrix split on either matrix dim (each rank writes its block); linear."""
    offset, d1, d2, n = _embed_dims(ctx)
    rest = [d for d in range(n) if d not in (d1, d2)]
    last = _n(ctx) - 1
    sigs = [((S(k),), (S(d),)) for k, d in enumerate(rest)]
    return sigs + [((S(last),), (P,)), ((B,), (S(d1),)), ((B,), (S(d2),)), ((P,), (P,))]


def embed_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The values this rank holds of the diagonal entries its output block holds, written in zeros."""
    offset, d1, d2, _ = _embed_dims(where.ctx)
    g = args[0]
    out = g.new_zeros(where.out_shape(0))
    box = where.out_box(0)
    lo, first, count = _local_diagonal(offset, box[d1], box[d2])
    g0, gn = where.in_box(0)[-1]
    a, b = max(first, g0), min(first + count, g0 + gn)
    if b > a:
        torch.diagonal(out, lo, d1, d2)[..., a - first:b - first] = g[..., a - g0:b - g0]
    return out


register([aten.diag_embed.default, aten.diagonal_backward.default], Rule(embed_signatures, kernel=embed_local))


def diagonal_scatter_signatures(ctx: Ctx) -> list:
    """(self, src) -> self's shape: batch dims split alike; self split on a matrix dim with src whole
    (each rank writes the entries its block holds); P self and src (the result is linear in both)."""
    n = _n(ctx)
    _, d1, d2 = _diag_args(ctx, n)
    rest = [d for d in range(n) if d not in (d1, d2)]
    sigs = [((S(d), S(k)), (S(d),)) for k, d in enumerate(rest)]
    return sigs + [((S(d1), B), (S(d1),)), ((S(d2), B), (S(d2),)), ((P, P), (P,))]


def diagonal_scatter_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    block = _block_diagonal(where)
    if block is None:
        return func(*args, **kwargs)
    n, d1, d2, lo, first, count = block
    out = args[0].clone()
    if count:
        torch.diagonal(out, lo, d1, d2).copy_(args[1][..., first:first + count])
    return out


register([aten.diagonal_scatter.default], Rule(diagonal_scatter_signatures, kernel=diagonal_scatter_local))


# -- ops that leave some dims alone ----------------------------------------------------------------
def others(moved: Any, partial: bool = True) -> Any:
    """Signatures of a one-tensor op that leaves every dim but `moved(ctx)` (a set) as it is."""
    def signatures(ctx: Ctx) -> list:
        skip = moved(ctx)
        sigs = [((S(d),), (S(d),)) for d in range(_n(ctx)) if d not in skip]
        return sigs + ([((P,), (P,))] if partial else [])
    return signatures


def _shifts(ctx: Ctx) -> dict:
    """{rolled dim: shift in [0, size)}; empty where roll flattens (no dims), which moves every dim."""
    dims = list(ctx.arg(2, "dims", []) or [])
    shape, out = ctx.shapes[0], {}
    for d, k in zip(dims, ctx.arg(1, "shifts")):
        d %= len(shape)
        out[d] = (out.get(d, 0) + k) % shape[d] if shape[d] else 0
    return out


def roll_signatures(ctx: Ctx) -> list:
    """Every split passes. A dim not rolled holds the same rows rolled; a split rolled dim stays that split,
    each rank receiving the rows that roll into its block from the ranks holding them (`roll_local`,
    charged by `roll_cost`), where a conversion first (to another dim's split) costs no less. Roll without
    dims rolls the flattened tensor: no split passes. Only moves values: P passes."""
    if not list(ctx.arg(2, "dims", []) or []):
        return [((P,), (P,))]
    return [((S(d),), (S(d),)) for d in range(_n(ctx))] + [((P,), (P,))]


def _roll_moves(ctx: Ctx, layout: Layout) -> tuple:
    """(dim, "roll", shift) for each rolled dim some mesh axis splits."""
    split = {s.dim for s in layout.sbp if isinstance(s, Split)}
    return tuple((d, "roll", k) for d, k in sorted(_shifts(ctx).items()) if d in split)


def roll_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The shard rolled along its whole rolled dims, then the rows that roll into it along the split ones."""
    layout, shape = where.in_layouts[0], tuple(where.ctx.shapes[0])
    moves = _roll_moves(where.ctx, layout)
    if not moves:
        return func(*args, **kwargs)
    shifts = _shifts(where.ctx)
    whole = [d for d in shifts if d not in {m[0] for m in moves} and shifts[d]]
    x = torch.roll(args[0], [shifts[d] for d in whole], whole) if whole else args[0]
    out = torch.empty_like(x)
    if where.checking:
        return out
    return exchange_moved(x, out, layout, shape, layout, shape, moves, where.rank)


def roll_cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> tuple:
    moves = _roll_moves(ctx, targets[0])
    if not moves:
        return (), 0
    shape = tuple(ctx.shapes[0])
    return moved_cost(targets[0], shape, targets[0], shape, moves, ctx.args[0].dtype.itemsize)


def _rolls_no_split(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    return not any(isinstance(s, Split) and s.dim in _shifts(ctx) for s in ins[0].sbp)


register([aten.roll.default],
         Rule(roll_signatures, kernel=roll_local, kernel_cost=roll_cost, plain_when=_rolls_no_split))


def _unfolded(ctx: Ctx) -> set:
    return {ctx.arg(1, "dimension") % max(_n(ctx), 1)}


register([aten.unfold.default, aten.unfold_copy.default], Rule(others(_unfolded)))


def unfold_backward_signatures(ctx: Ctx) -> list:
    """grad (the windows, one more dim) -> input's shape: dims other than the unfolded one pass."""
    n = len(ctx.out_shapes[0])
    dim = ctx.arg(2, "dim") % max(n, 1)
    return [((S(d),), (S(d),)) for d in range(n) if d != dim] + [((P,), (P,))]


def sized_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The op with this rank's output shard's sizes in place of the global ones (argument 1)."""
    return func(args[0], list(where.out_shape(0)), *args[2:], **kwargs)


register([aten.unfold_backward.default],
         Rule(unfold_backward_signatures, kernel=sized_local, plain_when=lambda *_: True))


def rot90_signatures(ctx: Ctx) -> list:
    """Dims not rotated pass. rot90 by one quarter is flip(d1) then transpose, so d0 is carried to d1 unflipped;
    by three quarters, d1 to d0; by none, everything passes."""
    n = _n(ctx)
    k = ctx.arg(1, "k", 1) % 4
    d0, d1 = (d % n for d in ctx.arg(2, "dims", [0, 1]))
    sigs = [((S(d),), (S(d),)) for d in range(n) if k == 0 or d not in (d0, d1)]
    if k == 1:
        sigs.append(((S(d0),), (S(d1),)))
    elif k == 3:
        sigs.append(((S(d1),), (S(d0),)))
    return sigs + [((P,), (P,))]


register([aten.rot90.default], Rule(rot90_signatures))


def repeat_signatures(ctx: Ctx) -> list:
    """A dim repeated once passes (shifted by the dims repeat puts in front). A split dim repeated r times is
    not r copies of each shard (the result's balanced split cuts the copies elsewhere): each rank receives
    the rows of its block from the ranks holding them (`repeat_local`, charged by `repeat_cost`), where no
    dims are put in front. Linear: P passes."""
    reps = list(ctx.arg(1, "repeats"))
    extra = len(reps) - _n(ctx)
    return [((S(d),), (S(d + extra),)) for d in range(_n(ctx)) if reps[d + extra] == 1 or not extra] + [((P,), (P,))]


def _repeat_moves(ctx: Ctx, layout: Layout) -> tuple:
    """(dim, "repeat", times) for each dim repeated more than once that some mesh axis splits."""
    reps = list(ctx.arg(1, "repeats"))
    if len(reps) != _n(ctx):
        return ()
    split = {s.dim for s in layout.sbp if isinstance(s, Split)}
    return tuple((d, "repeat", r) for d, r in enumerate(reps) if r > 1 and d in split)


def repeat_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The shard repeated along its whole dims, then the rows of its block along the split repeated ones."""
    layout = where.in_layouts[0]
    moves = _repeat_moves(where.ctx, layout)
    if not moves:
        return func(*args, **kwargs)
    moved = {d for d, _, _ in moves}
    reps = list(where.ctx.arg(1, "repeats"))
    x = args[0].repeat([1 if d in moved else r for d, r in enumerate(reps)])
    out = x.new_empty(where.out_shape(0))
    if where.checking:
        return out
    in_shape = tuple(n if d in moved else n * r for d, (n, r) in enumerate(zip(where.ctx.shapes[0], reps)))
    return exchange_moved(x, out, layout, in_shape, where.out_layouts[0], tuple(where.ctx.out_shapes[0]), moves,
                          where.rank)


def repeat_cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> tuple:
    moves = _repeat_moves(ctx, targets[0])
    if not moves:
        return (), 0
    moved = {d for d, _, _ in moves}
    reps = list(ctx.arg(1, "repeats"))
    in_shape = tuple(n if d in moved else n * r for d, (n, r) in enumerate(zip(ctx.shapes[0], reps)))
    return moved_cost(targets[0], in_shape, out_layouts[0], tuple(ctx.out_shapes[0]), moves,
                      ctx.args[0].dtype.itemsize)


register([aten.repeat.default], Rule(repeat_signatures, kernel=repeat_local, kernel_cost=repeat_cost,
                                     plain_when=lambda ctx, ins, outs: not _repeat_moves(ctx, ins[0])))


# -- select_scatter / slice_scatter ----------------------------------------------------------------
def select_scatter_signatures(ctx: Ctx) -> list:
    """(self, src) -> self's shape: other dims split alike; self split on dim with src whole (the rank
    holding the index writes it); P self and src."""
    n = _n(ctx)
    dim = ctx.arg(2, "dim") % n
    sigs = [((S(d), S(d - (d > dim))), (S(d),)) for d in range(n) if d != dim]
    return sigs + [((S(dim), B), (S(dim),)), ((P, P), (P,))]


def select_scatter_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    n = _n(where.ctx)
    dim = where.ctx.arg(2, "dim") % n
    start, size = where.in_box(0)[dim]
    full = where.ctx.shapes[0][dim]
    if size == full:
        return func(*args, **kwargs)
    index = where.ctx.arg(3, "index") % full
    if start <= index < start + size:
        return func(args[0], args[1], dim, index - start)
    return args[0].clone()


register([aten.select_scatter.default], Rule(select_scatter_signatures, kernel=select_scatter_local))


def slice_scatter_signatures(ctx: Ctx) -> list:
    """(self, src) -> self's shape: other dims split alike; self split on dim with src whole (each rank
    writes the sliced rows it holds); P self and src."""
    n = _n(ctx)
    dim = ctx.arg(2, "dim", 0) % n
    sigs = [((S(d), S(d)), (S(d),)) for d in range(n) if d != dim]
    return sigs + [((S(dim), B), (S(dim),)), ((P, P), (P,))]


def slice_scatter_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    ctx = where.ctx
    dim = ctx.arg(2, "dim", 0) % _n(ctx)
    start, size = where.in_box(0)[dim]
    full = ctx.shapes[0][dim]
    if size == full:
        return func(*args, **kwargs)
    rows = range(*slice(ctx.arg(3, "start"), ctx.arg(4, "end"), ctx.arg(5, "step", 1)).indices(full))
    mine = [k for k, r in enumerate(rows) if start <= r < start + size]
    if not mine:
        return args[0].clone()
    step = rows.step
    src = args[1].narrow(dim, mine[0], len(mine))
    first = rows[mine[0]] - start
    return func(args[0], src, dim, first, first + step * (len(mine) - 1) + 1, step)


register([aten.slice_scatter.default], Rule(slice_scatter_signatures, kernel=slice_scatter_local))


# -- searches: each element of one tensor looked up in another, needed whole -----------------------
def elementwise_lookup(ctx: Ctx) -> list:
    """isin / bucketize: (elements, the looked-up tensor) -> elements' shape, split alike."""
    return [((S(d), B), (S(d),)) for d in range(_n(ctx))]


register([aten.isin.Tensor_Tensor, aten.bucketize.Tensor], Rule(elementwise_lookup))


def searchsorted_signatures(ctx: Ctx) -> list:
    """(sorted, values[, sorter]) -> values' shape. A 1-D sorted sequence is looked up whole by any split of
    the values; an n-D one holds one sequence per leading index: those dims split alike in all, and the
    values' last dim splits with every sequence whole."""
    seq, vals = ctx.shapes[0], ctx.shapes[1]
    k = len(ctx.shapes) - 2  # a sorter, beside the sequence
    if len(seq) <= 1:
        return [((B, S(d)) + (B,) * k, (S(d),)) for d in range(len(vals))]
    sigs = [((S(d), S(d)) + (S(d),) * k, (S(d),)) for d in range(len(vals) - 1)]
    return sigs + [((B, S(len(vals) - 1)) + (B,) * k, (S(len(vals) - 1),))]


register([aten.searchsorted.Tensor], Rule(searchsorted_signatures))


# -- count_nonzero: a sum of indicators ------------------------------------------------------------
def count_nonzero_signatures(ctx: Ctx) -> list:
    """A reduced dim split gives Partial counts; a kept dim passes (shifted past the reduced ones before it)."""
    n = _n(ctx)
    if not n:
        return []
    dim = ctx.arg(1, "dim")
    reduced = set(range(n)) if dim is None or dim == [] else {d % n for d in ([dim] if isinstance(dim, int) else dim)}
    kept = [d for d in range(n) if d not in reduced]
    return [((S(d),), (P,)) for d in reduced] + [((S(d),), (S(k),)) for k, d in enumerate(kept)]


register([aten.count_nonzero.default, aten.count_nonzero.dim_IntList], Rule(count_nonzero_signatures))


# -- linspace / logspace with tensor ends ----------------------------------------------------------
def _spaced_signatures(ctx: Ctx) -> list:
    """The ends are 0-d (whole); the points may be split: each rank keeps its part of the points."""
    return [((B,) * len(ctx.shapes), (S(0),))]


def spaced_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    start, size = where.out_box(0)[0]
    return func(*args, **kwargs).narrow(0, start, size)


register([getattr(getattr(aten, op), o) for op in ("linspace", "logspace")
          for o in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")],
         Rule(_spaced_signatures, kernel=spaced_local))


# -- allclose: a Python bool of every element ------------------------------------------------------
def allclose_decompose(func: Any, args: tuple, kwargs: dict) -> bool:
    """torch's isclose written in pointwise ops (on the shards, split alike), then `all` and one boolean
    read (as `torch.equal`, ops/scalar.py): no input is gathered. A rank outside the placement is told the
    answer: a Python bool returned to every rank must be the same everywhere."""
    a, b = args[0], args[1]
    named = dict(zip(("rtol", "atol", "equal_nan"), args[2:]), **kwargs)
    rtol, atol = named.get("rtol", 1e-05), named.get("atol", 1e-08)
    close = aten.eq.Tensor(a, b)
    if named.get("equal_nan", False):
        close = aten.logical_or.default(close, aten.logical_and.default(aten.isnan.default(a), aten.isnan.default(b)))
    actual = aten.abs.default(aten.sub.Tensor(a, b))
    allowed = aten.add.Scalar(aten.abs.default(aten.mul.Scalar(b, rtol)), atol)
    finite = aten.logical_not.default(aten.logical_or.default(aten.isnan.default(actual), aten.isinf.default(actual)))
    close = aten.logical_or.default(close, aten.logical_and.default(finite, aten.le.Tensor(actual, allowed)))
    everywhere = aten.all.default(close)
    placement, comm = everywhere.placement, context.current()
    value = bool(aten._local_scalar_dense.default(everywhere)) if placement.coord(comm.rank) is not None else None
    if comm.world_size > placement.size:  # ranks outside the placement are told the answer, as they are the shapes
        got = comm.all_gather_object(value if comm.rank == placement.flat_ranks[0] else None,
                                     tuple(range(comm.world_size)))
        value = next(g for g in got if g is not None)
    return value


register([aten.allclose.default], Rule(lambda ctx: [], decompose=allclose_decompose))


# -- masked_scatter: the source read in the order of the mask's True entries -----------------------
def masked_scatter_signatures(ctx: Ctx) -> list:
    """(self, mask, source) -> the broadcast shape: self split with mask and source whole (each rank counts the
    True entries before its block in the whole mask); P self and source (linear jointly)."""
    out = ctx.out_shapes[0]
    self_shape = ctx.shapes[0]
    sigs = []
    for d in range(len(out)):
        s = pointwise_dims(self_shape, out, d)
        if s != B:
            sigs.append(((s, B, B), (S(d),)))
    return sigs + [((P, B, P), (P,))]


def _mask_positions(mask: torch.Tensor, shape: tuple, box: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mask on `box` of the broadcast `shape`, each entry's place in the source: the count of True
    entries before it in the whole mask, row-major)."""
    full = mask.expand(shape)
    pos = full.reshape(-1).to(torch.int64).cumsum(0).reshape(shape) - 1
    for d, (start, size) in enumerate(box):
        full, pos = full.narrow(d, start, size), pos.narrow(d, start, size)
    return full, pos.clamp(min=0)


def masked_scatter_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    x, mask, source = args[0], args[1], args[2]
    out_shape = where.ctx.out_shapes[0]
    if where.out_shape(0) == tuple(out_shape):
        return func(*args, **kwargs)
    local_mask, pos = _mask_positions(mask, tuple(out_shape), where.out_box(0))
    values = source.reshape(-1)[pos] if source.numel() else x.new_zeros(pos.shape)
    out = torch.where(local_mask, values, x)
    if is_inplace(func):
        return x.copy_(out)
    return out


register([aten.masked_scatter.default, aten.masked_scatter_.default],
         Rule(masked_scatter_signatures, kernel=masked_scatter_local))


def masked_scatter_backward_signatures(ctx: Ctx) -> list:
    """(grad, mask) -> the source's gradient: grad split with the mask whole gives Partial (each rank
    places the values of its block at their source places); P passes."""
    return [((S(d), B), (P,)) for d in range(_n(ctx))] + [((P, B), (P,))]


def masked_scatter_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    g, mask = args[0], args[1]
    shape = where.ctx.shapes[0]
    box = where.in_box(0)
    if all(n == s for (_, n), s in zip(box, shape)):
        return func(*args, **kwargs)
    local_mask, pos = _mask_positions(mask, tuple(shape), box)
    out = g.new_zeros(where.out_shape(0))
    flat = out.view(-1)
    flat.index_put_((pos[local_mask],), g[local_mask], accumulate=True)
    return out


register([aten.masked_scatter_backward.default],
         Rule(masked_scatter_backward_signatures, kernel=masked_scatter_backward_local))


# -- more writes along a dim: ops/indexing.py's kernels --------------------------------------------
def _dim(ctx: Ctx) -> int:
    return ctx.arg(1, "dim") % max(_n(ctx), 1)


def write_signatures(linear: bool) -> Any:
    """(self, index[, source or value]) -> self's shape, written along `dim` at the index's rows: a dim other
    than `dim` split alike in self and a source as large there; self split along `dim` with the rest whole
    (`write_along_dim`: writes for rows held elsewhere land in a spare row); P self and source where the
    result is linear in both (a copy, not a reduction)."""
    def signatures(ctx: Ctx) -> list:
        n, dim = _n(ctx), _dim(ctx)
        k = len(ctx.shapes)
        name = ctx.func._schema.name
        # scatter's index has self's dims and addresses the others by position: split alike with self;
        # index_fill/copy/reduce's is 1-D, along dim only: whole. A source is split alike; a fill value is 0-d
        alike = [0] + ([1] if "scatter" in name else []) + ([2] if k == 3 and "fill" not in name else [])
        sigs = []
        for d in range(n):
            if d == dim or any(len(ctx.shapes[i]) != n or ctx.shapes[i][d] != ctx.shapes[0][d] for i in alike):
                continue
            sigs.append((tuple(S(d) if i in alike else B for i in range(k)), (S(d),)))
        if n:
            sigs.append(((S(dim),) + (B,) * (k - 1), (S(dim),)))
        if linear and k == 3:
            sigs.append(((P, B, P), (P,)))
        return sigs
    return signatures


register([aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, aten.index_fill_.int_Scalar,
          aten.index_fill_.int_Tensor], Rule(write_signatures(False), kernel=write_along_dim))
register([aten.index_copy.default, aten.index_copy_.default], Rule(write_signatures(True), kernel=write_along_dim))
register([aten.index_reduce.default, aten.index_reduce_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two,
          aten.scatter.reduce, aten.scatter_.reduce, aten.scatter.value_reduce, aten.scatter_.value_reduce],
         Rule(write_signatures(False), kernel=write_along_dim))


# -- take / put: the flattened tensor addressed by value -------------------------------------------
def _flat_local(index: torch.Tensor, shape: tuple, box: tuple, elsewhere: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices into the tensor made into this rank's block, whether each is held here); those held
    elsewhere become `elsewhere`."""
    numel = 1
    for s in shape:
        numel *= s
    index = torch.where(index < 0, index + numel, index)
    local = torch.zeros_like(index)
    inside = torch.ones_like(index, dtype=torch.bool)
    rest = index
    for d in reversed(range(len(shape))):
        coord = rest % shape[d] if shape[d] else rest
        rest = rest // shape[d] if shape[d] else rest
        start, size = box[d]
        inside &= (coord >= start) & (coord < start + size)
        local = local + (coord - start) * _stride(box, d)
    return torch.where(inside, local, elsewhere), inside


def _stride(box: tuple, d: int) -> int:
    stride = 1
    for _, size in box[d + 1:]:
        stride *= size
    return stride


def take_signatures(ctx: Ctx) -> list:
    """(self, index) -> index's shape: a split index splits the output alike (self whole); a split self
    reads 0 for entries held elsewhere (P); P self passes."""
    return ([((B, S(d)), (S(d),)) for d in range(_n(ctx, 1))] +
            [((S(d), B), (P,)) for d in range(_n(ctx))] + [((P, B), (P,))])


def take_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    shape, box = where.ctx.shapes[0], where.in_box(0)
    if all(n == s for (_, n), s in zip(box, shape)):
        return func(*args, **kwargs)
    x = args[0]
    if x.numel() == 0:
        return x.new_zeros(where.out_shape(0))
    local, inside = _flat_local(args[1], tuple(shape), box, 0)
    return func(x, local).masked_fill(~inside, 0)


register([aten.take.default], Rule(take_signatures, kernel=take_local))


def put_signatures(ctx: Ctx) -> list:
    """(self, index, source) -> self's shape: self split with index and source whole (writes for entries
    held elsewhere land in a spare element); P self and source (linear jointly, as index_put)."""
    return [((S(d), B, B), (S(d),)) for d in range(_n(ctx))] + [((P, B, P), (P,))]


def put_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    shape, box = where.ctx.shapes[0], where.in_box(0)
    if all(n == s for (_, n), s in zip(box, shape)):
        return func(*args, **kwargs)
    x = args[0]
    local, _ = _flat_local(args[1], tuple(shape), box, x.numel())
    spare = torch.cat([x.reshape(-1), x.new_zeros(1)])
    out = func(spare, local, *args[2:], **kwargs)[:-1].reshape(x.shape)
    return x.copy_(out) if is_inplace(func) else out


register([aten.put.default, aten.put_.default], Rule(put_signatures, kernel=put_local))


# -- _unique: distinct values, as many as the data says --------------------------------------------
# run whole on every rank of the placement, as the other data-dependent ops (ops/datadependent.py)
register([aten._unique.default], Rule(no_signatures, decompose=whole))


# -- hash_tensor: a hash of each slice along the reduced dims ----------------------------------------
# kept dims pass; a split reduced dim would need a Partial of the hash's own combining, which no SBP is
register([aten.hash_tensor.default], reduction(None))


# -- histograms: counts are sums over the points -----------------------------------------------------
def _histogram_key(args: tuple, kwargs: dict) -> Any:
    """What the signatures read of the float arguments: whether a range fixes the bin edges."""
    return kwargs.get("range") is None


def histogram_signatures(ctx: Ctx) -> list:
    """(self[, bins][, weight]) -> (hist, bin_edges): the points (and their weights) split any way give
    Partial counts where the edges do not depend on the points (a bins tensor, or a range) and the counts
    are not normalized (density); the edges are the same on every rank."""
    if ctx.named("density", False):
        return []
    if ctx.func == aten.histogram.bin_ct and ctx.kwargs.get("range") is None:
        return []  # the edges span the points' min and max
    k = len(ctx.shapes)
    weight = 2 if ctx.func == aten.histogram.bins_tensor else 1  # the weight's slot, where given
    return [(tuple(S(d) if i in (0, weight) else B for i in range(k)), (P, B)) for d in range(_n(ctx))]


def histogram_meta(func: Any, args: tuple, kwargs: dict) -> tuple:
    """torch has no meta kernel for histograms; their shapes follow from the bins alone."""
    x, bins = args[0], args[1] if len(args) > 1 else kwargs.get("bins", 100)
    edges = bins.shape[0] if isinstance(bins, torch.Tensor) else bins + 1
    return x.new_empty((edges - 1,)), x.new_empty((edges,))


def histogramdd_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    x, bins = args[0], args[1]
    if func == aten._histogramdd_bin_edges.default:
        return [x.new_empty((b + 1,)) for b in bins]
    counts = [b.shape[0] - 1 for b in bins] if func == aten._histogramdd_from_bin_tensors.default else list(bins)
    return x.new_empty(counts)


register([aten.histogram.bin_ct, aten.histogram.bins_tensor],
         Rule(histogram_signatures, scalar_key=_histogram_key, meta=histogram_meta))


def histogramdd_signatures(ctx: Ctx) -> list:
    """(points [..., D], [bins...], [weight [...]]) -> counts: points split (with their weights) give Partial
    counts where the edges are fixed (bins tensors, or a range) and not normalized. _histogramdd_bin_edges
    only reads the points for their min and max: with a range given, any split gives the same edges."""
    if ctx.named("density", False):
        return []
    tensors_bins = ctx.func == aten._histogramdd_from_bin_tensors.default
    if not tensors_bins and ctx.kwargs.get("range", ctx.args[2] if len(ctx.args) > 2 else None) is None:
        return []
    k, points = len(ctx.shapes), range(_n(ctx) - 1)  # the last dim holds each point's coordinates
    if ctx.func == aten._histogramdd_bin_edges.default:
        return [((S(d),) + (B,) * (k - 1), (B,) * len(ctx.out_shapes)) for d in points]
    nbins = len(ctx.args[1]) if tensors_bins else 0
    return [(tuple(S(d) if i == 0 or i > nbins else B for i in range(k)), (P,)) for d in points]


register([aten._histogramdd_bin_edges.default, aten._histogramdd_from_bin_cts.default,
          aten._histogramdd_from_bin_tensors.default],
         Rule(histogramdd_signatures, meta=histogramdd_meta,
              scalar_key=lambda args, kwargs: (args[2] if len(args) > 2 else kwargs.get("range")) is None))


# -- _chunk_cat: the dims before `dim` are every tensor's alike ------------------------------------
def chunk_cat_signatures(ctx: Ctx) -> list:
    n, k = _n(ctx), len(ctx.shapes)
    dim = ctx.arg(1, "dim") % max(n, 1)
    return [((S(d),) * k, (S(d),)) for d in range(dim)] + [((P,) * k, (P,))]


register([aten._chunk_cat.default], Rule(chunk_cat_signatures))


# -- block_diag: every tensor placed in zeros --------------------------------------------------------
def block_diag_signatures(ctx: Ctx) -> list:
    """Each tensor split (on its first or its last dim; 0-d ones whole) gives a Partial result: each rank
    places its blocks, a whole tensor placed by one rank of the axis (`block_diag_local`); linear."""
    first = tuple(S(0) if s else B for s in ctx.shapes)
    last = tuple(S(len(s) - 1) if s else B for s in ctx.shapes)
    return [(first, (P,)), (last, (P,)), ((P,) * len(ctx.shapes), (P,))]


def block_diag_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """Each shard at its place in the whole result: a tensor's rows and columns follow those before it
    (a 1-D tensor is one row, a 0-d one a 1x1 block). A tensor whole on an axis where the result is Partial
    is placed by the rank at coordinate 0 of that axis alone, so that the sum counts it once."""
    tensors = args[0]
    if all(lay.sbp == where.out_layouts[0].sbp and not any(isinstance(s, Partial) for s in lay.sbp)
           for lay in where.in_layouts):
        return func(*args, **kwargs)
    out = tensors[0].new_zeros(where.out_shape(0)) if tensors else torch.zeros(where.out_shape(0))
    coord = where.in_layouts[0].placement.coord(where.rank)
    partial_axes = [a for a, s in enumerate(where.out_layouts[0].sbp) if isinstance(s, Partial)]
    row = col = 0
    for i, t in enumerate(tensors):
        shape = where.ctx.shapes[i]
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0] if shape else 1)
        lay = where.in_layouts[i]
        counted = all(not isinstance(lay.sbp[a], Broadcast) or coord[a] == 0 for a in partial_axes)
        if counted and t.numel():
            box = where.in_box(i)
            (r0, nr), (c0, nc) = (box[0], box[1]) if len(shape) == 2 else ((0, 1), box[0] if shape else (0, 1))
            out[row + r0:row + r0 + nr, col + c0:col + c0 + nc] = t.reshape(nr, nc)
        row, col = row + rows, col + cols
    return out


register([aten.block_diag.default], Rule(block_diag_signatures, kernel=block_diag_local))


# -- _unsafe_masked_index(_put_accumulate): x[indices] where a mask says, as indexing.py's rules ----
def _as_index_call(ctx: Ctx) -> Ctx:
    """The call as `self[indices]` (indexing.py's `_indexing` reads the indices at argument 1)."""
    k = sum(t is not None for t in ctx.args[2])
    return replace(ctx, args=(ctx.args[0], ctx.args[2]), shapes=(ctx.shapes[0],) + tuple(ctx.shapes[2:2 + k]))


def masked_index_signatures(ctx: Ctx) -> list:
    """(self, mask, *indices) -> where(mask, self[indices], fill): a dim not indexed passes from self, a broadcast
    dim of the indices from the indices; the mask split alike where it has the dim. The indexed dims stay whole,
    so torch's clamping of the indices is the same on the shards."""
    pos, bshape, dims, bdims = _indexing(_as_index_call(ctx))
    idx = [tuple(t.shape) for t in ctx.args[2] if t is not None]
    out, mask = ctx.out_shapes[0], ctx.shapes[1]
    sigs = [((S(d), pointwise_dims(mask, out, o)) + (B,) * len(idx), (S(o),)) for d, o in dims.items()]
    for j, o in bdims.items():
        split = tuple(pointwise_dims(s, bshape, j) for s in idx)
        if any(s != B for s in split):
            sigs.append(((B, pointwise_dims(mask, out, o)) + split, (S(o),)))
    return sigs


def masked_put_signatures(ctx: Ctx) -> list:
    """(self, mask, *indices, values) -> self's shape, values added where the mask says: a dim not indexed split
    alike in self and values (and the mask); P self and values; indices split along a broadcast dim with values
    split alike (each rank adds its part: P)."""
    pos, bshape, dims, bdims = _indexing(_as_index_call(ctx))
    idx = [tuple(t.shape) for t in ctx.args[2] if t is not None]
    mask, values = ctx.shapes[1], ctx.shapes[-1]
    result = [0] * (len(ctx.shapes[0]) - len(pos) + len(bshape))  # self[indices].shape
    for d, o in dims.items():
        result[o] = ctx.shapes[0][d]
    for j, o in bdims.items():
        result[o] = bshape[j]
    wb = (B,) * len(idx)
    sigs = [((S(d), pointwise_dims(mask, result, o)) + wb + (pointwise_dims(values, result, o),), (S(d),))
            for d, o in dims.items()]
    sigs.append(((P, B) + wb + (P,), (P,)))
    for j, o in bdims.items():
        split = tuple(pointwise_dims(s, bshape, j) for s in idx)
        if any(s != B for s in split):
            sigs.append(((P, pointwise_dims(mask, result, o)) + split + (pointwise_dims(values, result, o),), (P,)))
    return sigs


register([aten._unsafe_masked_index.default], Rule(masked_index_signatures))
register([aten._unsafe_masked_index_put_accumulate.default], Rule(masked_put_signatures))
