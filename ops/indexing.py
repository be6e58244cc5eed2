"""Indexing by tensors: gather/scatter along a dim, `x[idx]` (index.Tensor), index_put, index_select/index_add.

gather, scatter and scatter_add address `dim` by the index's values and
every other dim by position: with dim 0, index[i][j] reads or writes
self[index[i][j]][j]. So a dim other than `dim` may be split when self,
index and src have the same size there and are split alike. `x[idx]`
addresses its indexed dims by value and leaves the others alone: a split
of a dim that is not indexed passes, and a split index splits the output
along its broadcast dims.

A dim addressed by value may be split too, without moving anything: each
rank serves the entries whose index falls in its rows. A read of an entry
held elsewhere gives 0, so the output is P (Megatron's vocab-parallel
lookup); a write of an entry held elsewhere goes to a spare row appended
to the shard and dropped after. Indices count globally; negative ones
from the end. Everything is linear in the values read or written, so P
passes with the indices whole, and accumulating writes (scatter_add,
index_put(accumulate=True), index_add) take a split index with the values
split alike: each rank adds its part (the backward of a read with a split
index).
"""
from __future__ import annotations

from typing import Any

import torch

from .registry import PMAX, PMIN, B, Ctx, ShardSite, P, Rule, S, aten, is_inplace, pointwise_dims, register


def _dim(ctx: Ctx) -> int:
    return ctx.named("dim") % max(len(ctx.shapes[0]), 1)


def _same_size_dims(ctx: Ctx, slots: tuple, skip: int) -> list:
    """Dims other than `skip` where the tensors in `slots` all have the same size (they may be split alike)."""
    first = ctx.shapes[slots[0]]
    return [d for d in range(len(first)) if d != skip and all(len(ctx.shapes[i]) == len(first) and
                                                              ctx.shapes[i][d] == first[d] for i in slots)]


def _spare_row(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with one more (zero) row along dim, where writes meant for other ranks' rows land."""
    shape = list(x.shape)
    shape[dim] = 1
    return torch.cat([x, x.new_zeros(shape)], dim)


def _local_rows(index: torch.Tensor, start: int, size: int, full: int, elsewhere: int):
    """(index made local, whether each entry is held here); entries held elsewhere become `elsewhere`:
    the spare row for a write, 0 for a read (whose result is zeroed there after)."""
    index = torch.where(index < 0, index + full, index)
    inside = (index >= start) & (index < start + size)
    return torch.where(inside, index - start, elsewhere), inside


def _write_back(func: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """In-place variants (scatter_, index_put_) must leave the result in their target shard."""
    if is_inplace(func):
        return args[0].copy_(out)
    return out


# -- gather / scatter ------------------------------------------------------------------------------
def gather_signatures(ctx: Ctx) -> list:
    """(self, index) -> out: split alike on equal-sized dims other than dim; index split along dim with
    self whole; self split along dim (reads held elsewhere give 0: P); P/P(max)/P(min) self."""
    dim = _dim(ctx)
    sigs = [((S(d), S(d)), (S(d),)) for d in _same_size_dims(ctx, (0, 1), dim)]
    sigs.append(((B, S(dim)), (S(dim),)))
    sigs.append(((S(dim), B), (P,)))
    return sigs + [((p, B), (p,)) for p in (P, PMAX, PMIN)]


def read_along_dim(func, args, kwargs, where: ShardSite):
    """gather / index_select of a self split along `dim`: entries held elsewhere read 0 (the output is P)."""
    x, dim, index = args[0], args[1] % max(args[0].dim(), 1), args[2]
    if not where.ctx.shapes[0]:  # a 0-d self (torch takes it as one row): never split
        return func(*args, **kwargs)
    start, size = where.in_box(0)[dim]
    full = where.ctx.shapes[0][dim]
    if size == full:
        return func(*args, **kwargs)
    if x.numel() == 0:
        return x.new_zeros(where.out_shape(0))
    local, inside = _local_rows(index, start, size, full, 0)
    out = func(x, dim, local, *args[3:], **kwargs)
    if inside.dim() != out.dim():  # index_select: one index per row of dim
        shape = [1] * out.dim()
        shape[dim] = -1
        inside = inside.reshape(shape)
    return out.masked_fill(~inside, 0)


def scatter_signatures(accumulates: bool, value_arg: bool):
    """(self, index[, src]) -> out (self's shape): split alike on equal-sized dims other than dim; self
    split along dim (writes for other rows go to a spare row); P self and src (linear jointly); adding
    writes also take an index split along dim with src split alike."""
    def signatures(ctx: Ctx) -> list:
        dim = _dim(ctx)
        n = len(ctx.shapes)  # 2 with a scalar value, else 3
        sigs = [((S(d),) * n, (S(d),)) for d in _same_size_dims(ctx, tuple(range(n)), dim)]
        sigs.append(((S(dim),) + (B,) * (n - 1), (S(dim),)))
        if n == 3:
            sigs.append(((P, B, P), (P,)))
            if accumulates and ctx.shapes[1][dim:dim + 1] == ctx.shapes[2][dim:dim + 1]:
                sigs.append(((P, S(dim), S(dim)), (P,)))
        elif value_arg and _scatter_value_is_zero(ctx.args, ctx.kwargs):
            sigs.append(((P, B), (P,)))
        return sigs
    return signatures


def _scatter_value_is_zero(args: tuple, kwargs: dict) -> bool:
    v = args[3] if len(args) > 3 else kwargs.get("value")
    return not isinstance(v, torch.Tensor) and v == 0


def write_along_dim(func, args, kwargs, where: ShardSite):
    """scatter / index_add into a self split along `dim`: writes for rows held elsewhere land in a spare row."""
    x, dim, index = args[0], args[1] % max(args[0].dim(), 1), args[2]
    if not where.ctx.shapes[0]:  # a 0-d self (torch takes it as one row): never split
        return func(*args, **kwargs)
    start, size = where.in_box(0)[dim]
    full = where.ctx.shapes[0][dim]
    if size == full:
        return func(*args, **kwargs)
    local, _ = _local_rows(index, start, size, full, size)
    out = func(_spare_row(x, dim), dim, local, *args[3:], **kwargs)
    return _write_back(func, args, out.narrow(dim, 0, size))


# -- x[indices] and index_put ------------------------------------------------------------------------
def _indexing(ctx: Ctx) -> tuple:
    """(positions of the indexed dims, their broadcast shape, self dim -> output dim for the others,
    broadcast dim -> output dim) for `self[indices]`."""
    indices = ctx.args[1]
    shape = ctx.shapes[0]
    pos = [k for k, t in enumerate(indices) if t is not None]
    bshape = tuple(torch.broadcast_shapes(*[tuple(t.shape) for t in indices if t is not None]))
    rest = [d for d in range(len(shape)) if d not in pos]
    if pos == list(range(pos[0], pos[-1] + 1)):  # adjacent: the broadcast dims replace them in place
        first = pos[0]
        dims = {d: d if d < first else d - len(pos) + len(bshape) for d in rest}
        bdims = {j: first + j for j in range(len(bshape))}
    else:  # apart: the broadcast dims go first
        dims = {d: len(bshape) + i for i, d in enumerate(rest)}
        bdims = {j: j for j in range(len(bshape))}
    return pos, bshape, dims, bdims


def _index_shapes(ctx: Ctx) -> list:
    return [tuple(t.shape) for t in ctx.args[1] if t is not None]


def index_signatures(ctx: Ctx) -> list:
    """(self, *indices) -> out: a dim not indexed keeps its split; indices split along a broadcast dim
    split the output there; self split along an indexed dim reads 0 for entries held elsewhere (P)."""
    pos, bshape, dims, bdims = _indexing(ctx)
    idx = _index_shapes(ctx)
    wb = (B,) * len(idx)
    sigs = [((S(d),) + wb, (S(o),)) for d, o in dims.items()]
    for j, o in bdims.items():
        split = tuple(pointwise_dims(s, bshape, j) for s in idx)
        if any(s != B for s in split):
            sigs.append(((B,) + split, (S(o),)))
    sigs += [((S(k),) + wb, (P,)) for k in pos]
    return sigs + [((p,) + wb, (p,)) for p in (P, PMAX, PMIN)]


def _indexed_dims_held(args: tuple, where: ShardSite, spare: bool):
    """The indices made local for the indexed dims this rank holds only part of: (indices, masks, dims)."""
    indices = list(args[1])
    box = where.in_box(0)
    masks, dims = [], []
    for k, t in enumerate(indices):
        full = where.ctx.shapes[0][k]
        start, size = box[k]
        if t is None or size == full:
            continue
        local, inside = _local_rows(t, start, size, full, size if spare else 0)
        indices[k] = local
        masks.append(inside)
        dims.append(k)
    return indices, masks, dims


def index_local(func, args, kwargs, where: ShardSite):
    indices, masks, _ = _indexed_dims_held(args, where, spare=False)
    if not masks:
        return func(*args, **kwargs)
    x = args[0]
    if x.numel() == 0:
        return x.new_zeros(where.out_shape(0))
    out = func(x, indices, *args[2:], **kwargs)
    pos, bshape, dims, bdims = _indexing(where.ctx)
    inside = masks[0]
    for m in masks[1:]:
        inside = inside & m
    lead = min(bdims.values(), default=0)  # where the broadcast dims sit in the output
    local_bshape = out.shape[lead:lead + len(bshape)]
    view = [1] * lead + list(local_bshape) + [1] * (out.dim() - lead - len(bshape))
    return out.masked_fill(~torch.broadcast_to(inside, local_bshape).reshape(view), 0)


def index_put_signatures(ctx: Ctx) -> list:
    """(self, *indices, values) -> out (self's shape): a dim not indexed split alike in self and values;
    self split along an indexed dim (writes for other rows go to a spare row); P self and values;
    accumulating, indices split along a broadcast dim with values split alike (each rank adds its part)."""
    pos, bshape, dims, bdims = _indexing(ctx)
    idx = _index_shapes(ctx)
    values = ctx.shapes[-1]
    result = [0] * (len(ctx.shapes[0]) - len(pos) + len(bshape))  # self[indices].shape, sizes that matter
    for d, o in dims.items():
        result[o] = ctx.shapes[0][d]
    for j, o in bdims.items():
        result[o] = bshape[j]
    wb = (B,) * len(idx)
    sigs = [((S(d),) + wb + (pointwise_dims(values, result, o),), (S(d),)) for d, o in dims.items()]
    sigs += [((S(k),) + wb + (B,), (S(k),)) for k in pos]
    sigs.append(((P,) + wb + (P,), (P,)))
    if ctx.named("accumulate", False):
        for j, o in bdims.items():
            split = tuple(pointwise_dims(s, bshape, j) for s in idx)
            if any(s != B for s in split):
                sigs.append(((P,) + split + (pointwise_dims(values, result, o),), (P,)))
    return sigs


def index_put_local(func, args, kwargs, where: ShardSite):
    indices, _, dims = _indexed_dims_held(args, where, spare=True)
    if not dims:
        return func(*args, **kwargs)
    x = args[0]
    padded = x
    for k in dims:
        padded = _spare_row(padded, k)
    out = func(padded, indices, *args[2:], **kwargs)
    for k in dims:
        out = out.narrow(k, 0, x.shape[k])
    return _write_back(func, args, out)


# -- index_select / index_add -------------------------------------------------------------------------
def index_select_signatures(ctx: Ctx) -> list:
    """(self, index) -> out: other dims keep their split; a split index splits dim; self split along dim
    reads 0 for entries held elsewhere (P)."""
    dim = _dim(ctx)
    sigs = [((S(d), B), (S(d),)) for d in range(len(ctx.shapes[0])) if d != dim]
    sigs += [((B, S(0)), (S(dim),)), ((S(dim), B), (P,))]
    return sigs + [((p, B), (p,)) for p in (P, PMAX, PMIN)]


def index_add_signatures(ctx: Ctx) -> list:
    """(self, index, source) -> out: other dims split alike in self and source; self split along dim
    (additions for other rows go to a spare row); P self and source; a split index with source split
    along dim alike (each rank adds its part)."""
    dim = _dim(ctx)
    sigs = [((S(d), B, S(d)), (S(d),)) for d in _same_size_dims(ctx, (0, 2), dim)]
    sigs += [((S(dim), B, B), (S(dim),)), ((P, B, P), (P,)), ((P, S(0), S(dim)), (P,))]
    return sigs


register([aten.gather.default], Rule(gather_signatures, kernel=read_along_dim))
register([aten.scatter.src, aten.scatter_.src], Rule(scatter_signatures(False, False), kernel=write_along_dim))
register([aten.scatter.value, aten.scatter_.value],
         Rule(scatter_signatures(False, True), kernel=write_along_dim, scalar_key=_scatter_value_is_zero))
register([aten.scatter_add.default, aten.scatter_add_.default],
         Rule(scatter_signatures(True, False), kernel=write_along_dim))
register([aten.index.Tensor, aten._unsafe_index.Tensor], Rule(index_signatures, kernel=index_local))
register([aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
          aten._unsafe_index_put.default], Rule(index_put_signatures, kernel=index_put_local))
register([aten.index_select.default], Rule(index_select_signatures, kernel=read_along_dim))
register([aten.index_add.default, aten.index_add_.default], Rule(index_add_signatures, kernel=write_along_dim))
