"""Ops on strided tensors (`Strided(d, g)`): on the strided reading where that is exact, else box to a split.

Where every block of d divides evenly by its mesh axis (`Layout.strided_even`, the usual case: a fused
gate_up projection's 2I rows on a power-of-two axis), a strided layout holds the shards that `Split(d)`
holds of the tensor with d permuted into the order the ranks hold its rows (`Layout.strided_order`). An
op for which permuting d's rows permutes one dim of every operand and result alike (the table of
`zigzag_dims.py`: pointwise ops, views that keep d one dim, transposes, matrix products, row-wise
kernels, reductions; here also bmm and `_grouped_mm` with d a row, column or contracted dim) gives the
same rows whichever order d is in, so it runs through the dispatcher on that reading: strided inputs
read as `Split`, other operands that span d permuted alike (a local index_select where a rank holds d
whole, else boxed to the strided layout first), results read back as strided (a result split on d on
the strided axis is strided; one holding d whole is permuted back locally).

The ops that separate the groups (`split`/`chunk`/`narrow`/`slice` of d at block boundaries, as
`gate, up = proj.chunk(2, -1)`) give each rank its own pieces of those blocks: a plain split of each
group (or a strided split of several), locally and with no bytes. Their backward's `cat` of the blocks'
gradients (plain splits, of the layout and shape the separation gave) is the reverse (`cat_of_splits`,
from GlobalTensor's dispatch): its result is strided, where the dispatcher's cat rule would recut every
piece. Only there: a cat of splits whose pieces no strided tensor was separated into in this rank's
program (a packed weight split contiguously, `ops/view.py`'s recut) keeps the cat rule, since its
consumers hold the contiguous split and a strided result would move the recut onto the weight's gradient. Every other op (or an uneven layout) gets its
strided inputs boxed to `Split(d)` first (one exchange each) and runs as usual: correct, not free. An
in-place op that the reading does not cover is refused on a strided tensor: its result would land in a copy.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Optional

import torch

from .. import boxing
from ..layout import Layout
from ..runtime import context
from ..sbp import Broadcast, Partial, Ragged, Split, Strided, Zigzag
from .decide import flatten_out, map_tensors
from .dispatch import run as dispatch
from .reading import on_reading
from .registry import aten, is_inplace
from .step_plan import ACTIVE as STEP_PLAN
from .view import reshape_groups
from .zigzag_dims import ALIGN, _pointwise, _mm

VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
GROUP_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.narrow.default)
# results whose values do not depend on the operand's values (zeros, empty, a fill): read in any order
VALUE_FREE = (aten.new_zeros.default, aten.new_empty.default, aten.new_full.default, aten.new_ones.default,
              aten.new_empty_strided.default)
SAME = (aten.detach.default, aten.alias.default, aten.clone.default, aten.copy_.default, aten.lift_fresh.default)


class _Separated(threading.local):
    """Per rank (a simulated rank is a thread), the (layout, shape, dim, count) of the plain-split blocks that a
    strided tensor was separated into so far: the cats that give a strided split back. Per rank, so every
    rank decides a cat from its own program's past, the same at the same point of the same program."""

    def __init__(self) -> None:
        self.keys: set = set()


_SEPARATED = _Separated()
MAX_SEPARATED = 4096


def _bmm(func, args, kwargs, shapes, ref, d):
    """bmm(a [b,n,k], b [b,k,m]): the batch is both operands' and the result's dim 0; a's rows the
    result's dim 1, b's columns its dim 2; a's dim 2 and b's dim 1 are contracted."""
    if d == 0:
        return [0, 0], lambda outs: [0]
    if (ref, d) == (0, 1):
        return [1, None], lambda outs: [1]
    if (ref, d) == (1, 2):
        return [None, 2], lambda outs: [2]
    return [2, 1], lambda outs: [None]


def _grouped_mm(func, args, kwargs, shapes, ref, d):
    """`_grouped_mm(a, b, offs)`: [M,k] @ [G,k,n] -> [M,n] and (the weight gradient) [k,M] @ [M,n] -> [G,k,n].
    The token rows M carry the groups (offs), so only k (contracted) and the weight side's dims go."""
    if len(shapes) != 3 or ref == 2:
        return None
    a, b = shapes[0], shapes[1]
    if len(a) == 2 and len(b) == 3:
        if (ref, d) == (1, 2):
            return [None, 2, None], lambda outs: [1]
        if (ref, d) in ((0, 1), (1, 1)):
            return [1, 1, None], lambda outs: [None]
        return None
    if len(a) == 2 and len(b) == 2:
        if (ref, d) == (1, 1):
            return [None, 1, None], lambda outs: [2]
        if (ref, d) == (0, 0):
            return [0, None, None], lambda outs: [1]
    return None


def _leading(indices: list) -> Optional[tuple[int, int]]:
    """(m, k) of advanced indexing by tensors on the leading m dims (k: their broadcast ndim); None otherwise."""
    at = [i for i, t in enumerate(indices) if t is not None]
    if at != list(range(len(at))) or not at:
        return None
    return len(at), max(t.dim() for t in indices if t is not None)


def _index(func, args, kwargs, shapes, ref, d):
    """`x[idx]` (index.Tensor) with index tensors on leading dims before d (an experts weight's selection):
    d stays one dim of the result, after the index's dims."""
    lead = _leading(list(args[1]))
    if ref != 0 or lead is None or lead[0] > d:
        return None
    m, k = lead
    return [d] + [None] * (len(shapes) - 1), lambda outs: [d - m + k]


def _index_put(func, args, kwargs, shapes, ref, d):
    """index_put(x, idx, values): its backward (`x` zeros, values the selection's gradient), as `_index`."""
    lead = _leading(list(args[1]))
    if lead is None:
        return None
    m, k = lead
    full = len(shapes[0]) - m + k  # the selection's ndim, which values broadcast to (right-aligned)
    at_values = lambda x: x - m + k - (full - len(shapes[-1]))  # noqa: E731
    if ref == 0:
        x = d
    elif ref == len(shapes) - 1:
        x = d + m - k + (full - len(shapes[-1]))
    else:
        return None
    if x < m or x >= len(shapes[0]):
        return None
    v = at_values(x)
    return [x] + [None] * (len(shapes) - 2) + [v if v >= 0 else None], lambda outs: [x]


def _select(func, args, kwargs, shapes, ref, d):
    """select(x, dim, i) of another dim: d stays (one to the left past dim); select_backward the reverse."""
    if func is aten.select.int:
        dim = args[1] % len(shapes[0])
        return None if dim == d else ([d], lambda outs: [d - (dim < d)])
    dim = args[2] % len(args[1])  # select_backward(grad, input_sizes, dim, index)
    return [d], lambda outs: [d + (dim <= d)]


TABLE = dict(ALIGN)
TABLE.update({op: _pointwise for op in SAME})
TABLE.update({aten.bmm.default: _bmm, aten.mm.default: _mm, aten._grouped_mm.default: _grouped_mm,
              aten.index.Tensor: _index, aten.index_put.default: _index_put, aten.index_put_.default: _index_put,
              aten._index_put_impl_.default: _index_put, aten.select.int: _select,
              aten.select_backward.default: _select})


def _key(layout: Layout) -> tuple[int, int, int]:
    a = layout.strided_axes[0]
    s = layout.sbp[a]
    return a, s.dim, s.groups


def _box(t: Any, layout: Layout, plain: type) -> Any:
    local = boxing.convert_local(t._local, t._layout, layout, tuple(t.shape), context.current())
    return plain(local, layout, tuple(t.shape))


def _as_split(t: Any, plain: type) -> Any:
    """`t` boxed to its contiguous split (`Split(d)` where it is strided): real rows, in order."""
    return _box(t, t._layout.strided_as_split(), plain)


def _cuts(layout: Layout, dim: int) -> list[int]:
    return [a for a, s in enumerate(layout.sbp) if isinstance(s, (Split, Zigzag, Ragged, Strided)) and s.dim == dim]


def _with_axis(layout: Layout, dim: int, axis: int, sbp: Any) -> Layout:
    """`layout` with no cut of `dim` but `sbp` on `axis`."""
    return Layout(layout.placement, tuple(sbp if a == axis else Broadcast() if a in _cuts(layout, dim) else s
                                          for a, s in enumerate(layout.sbp)))


def run(func: Any, args: tuple, kwargs: dict, plain: type, cls: type) -> Any:
    """`func` on arguments of which at least one is a strided tensor."""
    tensors: list = []
    map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    first = next(t for t in tensors if isinstance(t, cls))
    axis, d, g = _key(first._layout)
    if func in GROUP_OPS and args[0] is first:
        done = _separate(func, args, kwargs, plain, first, axis, d, g)
        if done is not None:
            return done
    if func in VIEWS and args[0] is first:
        done = _unmerged_view(func, args, kwargs, plain, first, axis, d, g)
        if done is not None:
            return done
    if func.name().startswith("aten::_foreach_"):  # per tensor, back through here (or its kernel on like shards)
        return dispatch(func, args, kwargs, plain)
    if func in VALUE_FREE:  # the values are not read: the reading where it holds the shard as it is
        def free(t: Any, i: int) -> Any:
            if not isinstance(t, cls):
                return t
            if t._layout.strided_even(tuple(t.shape)):
                return plain(t._local, t._layout.strided_as_split(), tuple(t.shape))
            return _as_split(t, plain)
        new_args, new_kwargs = map_tensors(args, kwargs, free)
        return dispatch(func, new_args, new_kwargs, plain)
    rule = TABLE.get(func)
    if rule is not None and not (is_inplace(func) and not isinstance(args[0], cls)):
        shapes = [tuple(t.shape) for t in tensors]
        for ref, t in enumerate(tensors):  # each strided operand in turn (a bias is never a product's reference)
            if not isinstance(t, cls) or not t._layout.strided_even(tuple(t.shape)):
                continue
            dim = t._layout.sbp[axis].dim
            alignment = rule(func, args, kwargs, shapes, ref, dim) if rule is not ALIGN.get(aten.view.default) \
                else rule(func, args, kwargs, shapes, ref, dim, lambda n: None)
            if alignment is not None:
                done = _on_reading(func, args, kwargs, plain, cls, t, alignment)
                if done is not None:
                    return done
                break
    if is_inplace(func) and isinstance(args[0], cls):
        raise NotImplementedError(
            f"{func}: writes a strided tensor ({args[0].sbp}) in place, which only ops on its strided reading do; "
            f"box it first: x = x.to_global(x.placement, {args[0]._layout.strided_as_split().sbp})")
    new_args, new_kwargs = map_tensors(args, kwargs, lambda t, i: _as_split(t, plain) if isinstance(t, cls) else t)
    left: list = []
    map_tensors(new_args, new_kwargs, lambda t, i: left.append(t))
    if any(isinstance(t, plain) and type(t) is not plain for t in left):
        return func(*new_args, **new_kwargs)  # an operand of another class (a ragged tensor) takes its own op path
    return dispatch(func, new_args, new_kwargs, plain)


def _order(t: Any, layout: Layout, dim: int, device: Any, inverse: bool = False) -> torch.Tensor:
    a, _, g = _key(layout)
    order = torch.tensor(layout.strided_order(tuple(t.shape)) if layout.sbp[a].dim == dim else
                         _with_axis(layout, dim, a, Strided(dim, g)).strided_order(tuple(t.shape)), dtype=torch.long)
    return (torch.argsort(order) if inverse else order).to(device)


def _on_reading(func, args, kwargs, plain, cls, first, alignment) -> Any:
    in_dims, out_dims = alignment
    axis, d, g = _key(first._layout)
    length = first.shape[d]
    placement = first._layout.placement

    def read(t: Any, i: int) -> Any:
        dim = in_dims[i]
        if dim is None or t.ndim <= dim or t.shape[dim] == 1:
            if i == 0 and is_inplace(func):
                return None  # a copy of args[0] written in place would be lost
            return _as_split(t, plain) if isinstance(t, cls) else t
        if not hasattr(t, "_layout"):  # a plain tensor: Broadcast, the same on every rank
            t = plain(t, Layout(placement, (Broadcast(),) * placement.ndim), tuple(t.shape))
        if t.shape[dim] != length or t._layout.placement != placement:
            return None
        if isinstance(t, cls) and _key(t._layout) == (axis, dim, g) and \
                t._layout == _with_axis(t._layout, dim, axis, Strided(dim, g)):
            return plain(t._local, t._layout.strided_as_split(), tuple(t.shape))  # strided as the reading is
        if i == 0 and is_inplace(func):
            return None  # a copy of args[0] written in place would be lost
        if isinstance(t, cls):  # strided otherwise: its contiguous split first
            t = _as_split(t, plain)
        target = _with_axis(t._layout, dim, axis, Strided(dim, g))
        if t._layout.ragged_axes or not target.strided_even(tuple(t.shape)):
            return None  # an operand the reading cannot hold alike (ragged, uneven): the strided one is boxed
        if _cuts(t._layout, dim):
            t = _box(t, target, plain)
            return plain(t._local, target.strided_as_split(), tuple(t.shape))
        local = t._local
        if local.dim() > dim:
            local = local.index_select(dim, _order(t, target, dim, local.device))
        return plain(local, t._layout, tuple(t.shape))
    return on_reading(func, args, kwargs, plain, read, out_dims, lambda o, dim: _back(o, dim, axis, g, length, plain))


def _back(o: Any, dim: int, axis: int, g: int, length: int, plain: type) -> Any:
    """A result on the reading back as the tensor it stands for: strided where the strided axis splits
    `dim` (else boxed so), or, holding `dim` whole, put back in order."""
    if o.shape[dim] != length:
        raise AssertionError(f"strided reading: a result's dim {dim} has {o.shape[dim]} rows, not {length}")
    layout = o._layout
    target = _with_axis(layout, dim, axis, Strided(dim, g))
    if layout == target.strided_as_split():
        return plain(o._local, target, tuple(o.shape))
    if not _cuts(layout, dim):
        local = o._local
        if local.dim() > dim:
            local = local.index_select(dim, _order(o, target, dim, local.device, inverse=True))
        return plain(local, layout, tuple(o.shape))
    o = _box(o, target.strided_as_split(), plain)
    return plain(o._local, target, tuple(o.shape))


def _separate(func, args, kwargs, plain, x, axis, d, g) -> Any:
    """split/split_with_sizes/slice/narrow of the strided dim at block boundaries: each piece of k blocks is
    this rank's pieces of them, a split (k = 1) or a strided split (k > 1) of the piece; None otherwise."""
    ndim, length = x.ndim, x.shape[d]
    block = length // g
    names = {aten.split.Tensor: ("split_size", "dim"), aten.split_with_sizes.default: ("split_sizes", "dim"),
             aten.narrow.default: ("dim", "start", "length"), aten.slice.Tensor: ("dim", "start", "end", "step")}[func]
    given = dict(zip(names, args[1:]))
    given.update(kwargs)
    dim = given.get("dim", 0) % ndim
    if dim != d:
        return None
    if func is aten.split.Tensor:
        size = given["split_size"]
        cuts = [(s, min(size, length - s)) for s in range(0, length, size)] if size else [(0, length)]
    elif func is aten.split_with_sizes.default:
        starts = [sum(given["split_sizes"][:i]) for i in range(len(given["split_sizes"]))]
        cuts = list(zip(starts, given["split_sizes"]))
    elif func is aten.narrow.default:
        cuts = [(given["start"] % length if given["start"] < 0 else given["start"], given["length"])]
    else:
        if given.get("step", 1) != 1:
            return None
        start, end = given.get("start"), given.get("end")
        start = 0 if start is None else max(min(start + length if start < 0 else start, length), 0)
        end = length if end is None else max(min(end + length if end < 0 else end, length), start)
        cuts = [(start, end - start)]
    if any(s % block or n % block or not n for s, n in cuts):
        return None
    local = x._local
    if local.dim() != ndim:
        return None
    here = local.shape[d] // g
    outs = []
    for s, n in cuts:
        k = n // block
        sbp = tuple((Split(d) if k == 1 else Strided(d, k)) if a == axis else t for a, t in enumerate(x._layout.sbp))
        shape = tuple(x.shape[:d]) + (n,) + tuple(x.shape[d + 1:])
        outs.append(plain(local.narrow(d, s // block * here, k * here), Layout(x._layout.placement, sbp), shape))
    if len(outs) == g:  # every block on its own: their gradients' cat is this layout again
        keys = _SEPARATED.keys
        if len(keys) >= MAX_SEPARATED:
            keys.clear()
        keys.add((outs[0]._layout, tuple(outs[0].shape), d, g))
    return outs if func in (aten.split.Tensor, aten.split_with_sizes.default) else outs[0]


def cat_of_splits(args: tuple, kwargs: dict, plain: type) -> Optional[Any]:
    """`cat` of tensors that one mesh axis splits along the cat dim, all else alike and of equal length, as a
    strided tensor's blocks were separated into earlier in this rank's program (`_SEPARATED`): the strided split
    of the result (each rank's pieces, concatenated locally; no bytes). None otherwise."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or type(tensors[0]) is not plain:
        return None
    t0 = tensors[0]
    layout, shape = t0._layout, tuple(t0.shape)
    if not shape or t0._local.dim() != len(shape):
        return None
    dim %= len(shape)
    if any(type(t) is not plain or t._layout != layout or tuple(t.shape) != shape for t in tensors[1:]):
        return None
    axes = _cuts(layout, dim)
    if len(axes) != 1 or not isinstance(layout.sbp[axes[0]], Split) or layout.placement.shape[axes[0]] < 2:
        return None
    g = len(tensors)
    if (layout, shape, dim, g) not in _SEPARATED.keys:
        return None
    sbp = tuple(Strided(dim, g) if a == axes[0] else s for a, s in enumerate(layout.sbp))
    out_shape = shape[:dim] + (shape[dim] * g,) + shape[dim + 1:]
    return plain(torch.cat([t._local for t in tensors], dim), Layout(layout.placement, sbp), out_shape)


def _view_shape(args: tuple, kwargs: dict, numel: int) -> Optional[tuple]:
    size = args[1] if len(args) > 1 else kwargs.get("size", kwargs.get("shape"))
    if size is None:
        return None
    size = [int(x) for x in size]
    if size.count(-1) == 1:
        rest = math.prod(x for x in size if x != -1)
        size[size.index(-1)] = numel // rest if rest else 0
    return tuple(size) if math.prod(size) == numel else None


def _one_split_axis(layout: Layout, kind: type) -> Optional[int]:
    """The one mesh axis whose SBP is a `kind`, every other axis Partial or of size 1; None else. (A Broadcast
    axis may slice the dims before the split for free, keeping the merged dim one contiguous split: the
    dispatcher's reshape rule finds that.)"""
    shape = layout.placement.shape
    cut = [a for a, x in enumerate(layout.sbp) if not isinstance(x, Partial) and shape[a] > 1]
    return cut[0] if len(cut) == 1 and isinstance(layout.sbp[cut[0]], kind) else None


def merged_view(func: Any, args: tuple, kwargs: dict, plain: type) -> Optional[Any]:
    """A view that merges a split dim k with dims before it into one dim ([S, B, d] S(1) -> [S*B, d]: the batch
    split of a sequence-first activation, as `nn.MultiheadAttention` flattens it for its projections): each
    rank holds its piece of every block of the merged dim, which is the strided split `S(o, groups=G)` (G the
    elements of the dims before k), with no bytes, where a contiguous split of the merged dim is an all-to-all
    (and the view back another). Its readers take it as it is where exact (`run`), the view back included
    (`_unmerged_view`). Only with one mesh axis cutting, k's pieces even; None otherwise (the dispatcher's
    rules decide). Not under a step plan (`ops/step_plan.py`), which chooses among the dispatcher's choices for
    the whole step, this one among them: taken outside it, the plan's choices after it no longer fit."""
    t = args[0]
    if func not in VIEWS or type(t) is not plain or STEP_PLAN.plan is not None:
        return None
    layout = t._layout
    axis = _one_split_axis(layout, Split)
    if axis is None:
        return None
    n, k, ins = layout.placement.shape[axis], layout.sbp[axis].dim, tuple(t.shape)
    if n < 2 or ins[k] % n or t._local.dim() != len(ins):
        return None
    outs = _view_shape(args, kwargs, math.prod(ins))
    if outs is None:
        return None
    for gi, gj in reshape_groups(ins, outs):
        if k not in gi:
            continue
        merged = [j for j in gj if outs[j] != 1]
        groups = math.prod(ins[x] for x in gi[:gi.index(k)])
        if len(merged) != 1 or groups < 2:
            return None
        o = merged[0]
        local_shape = list(outs)
        local_shape[o] //= n
        try:
            local = func(t._local, local_shape)
        except RuntimeError:  # not a view of this rank's shard (its strides): the dispatcher's way
            return None
        sbp = tuple(Strided(o, groups) if a == axis else x for a, x in enumerate(layout.sbp))
        return plain(local, Layout(layout.placement, sbp), outs)
    return None


def _unmerged_view(func, args, kwargs, plain, x, axis, d, g) -> Optional[Any]:
    """The view that undoes `merged_view`: the strided dim d cut into dims whose leading ones hold its g blocks
    ([S*B, d] S(0, groups=S) -> [S, B, d] S(1)): each rank's pieces are its split of the dim after them, no bytes.
    None otherwise."""
    layout = x._layout
    if _one_split_axis(layout, Strided) != axis or not layout.strided_even(tuple(x.shape)):
        return None
    ins, n = tuple(x.shape), layout.placement.shape[axis]
    outs = _view_shape(args, kwargs, math.prod(ins))
    if outs is None or x._local.dim() != len(ins):
        return None
    for gi, gj in reshape_groups(ins, outs):
        if d not in gi:
            continue
        if [i for i in gi if ins[i] != 1] != [d]:
            return None
        lead = 1
        for at, j in enumerate(gj):
            if lead == g:
                if outs[j] % n:
                    return None
                local_shape = list(outs)
                local_shape[j] //= n
                try:
                    local = func(x._local, local_shape)
                except RuntimeError:
                    return None
                sbp = tuple(Split(j) if a == axis else s for a, s in enumerate(layout.sbp))
                return plain(local, Layout(layout.placement, sbp), outs)
            lead *= outs[j]
        return None
    return None


__all__ = ["run", "cat_of_splits", "merged_view"]
