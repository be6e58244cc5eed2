"""Ragged tensors: a Split whose per-rank sizes are data (`gt.ragged(dim)`), carried by the tensor.

The layout holds `Ragged(dim)` without sizes, so every cache keyed on layouts stays keyed on
structure; a `RaggedTensor` holds the sizes (per ragged mesh axis, the same on every rank of that
axis: they cut the one global dim). Only ops whose shards stay meaningful with any cut accept
one, and they run here, not in the dispatcher, whose decisions assume balanced shards:

- pointwise ops (sizes pass through; a Broadcast operand is sliced to the rows each rank holds),
  `*_like` factories, unsqueeze/expand (a sum's backward), sums (over the ragged dim: Partial),
  conversions (`to_global`), and the grouped ops of `globaltensor/grouped.py`;
- generally, every op whose rule lets a split of the ragged dim pass through (it works along other
  dims: softmax, topk, one_hot, cumsum and argsort along others, bmm over it as the batch):
  `_by_rule`, on the shards, no data moved;
- every other op refuses a ragged input naming the op and the input (or, a reshape's runs, gets
  them balanced): a rule written for balanced shards would compute wrong values silently.

A user's ragged tensor cuts its dim over exactly one mesh axis (no other axis splits that dim),
which keeps every conversion a re-cut of contiguous ranges over one axis group (`boxing/ragged.py`).
A reshape's runs (`_unit`) may nest over several axes; their sizes follow from the unit on every
rank, so conversions that change several axes at once exchange blocks point to point.
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map

from .boxing import convert_local
from .boxing.boxes import intersect, numel, relative
from .boxing import ragged as _recut
from .layout import Layout, normalize_sbp, slice_box
from .ops import view as _view
from .ops.decide import _valid, axis_candidates, flatten_out, map_tensors
from .ops.errors import data_dependent
from .ops.pointwise import cast_meta, elementwise_meta
from .ops.registry import RULES, Ctx, Local, is_inplace
from .placement import Placement
from .runtime import context
from .sbp import Broadcast, Partial, Ragged, Split, split_range, split_sizes
from .tensor import GlobalTensor, _wrap, _tensor_key, device_for, grad_layout

aten = torch.ops.aten
Sizes = tuple  # per mesh axis: None, or one size per rank of the axis


class RaggedTensor(GlobalTensor):
    """A GlobalTensor with `_sizes`: for each mesh axis that is `Ragged(d)`, the rows of d per rank."""

    _sizes: Sizes
    # rows per element of a balanced split's dim where a reshape made the ragged split (ops/view.py's
    # uneven_merge): the sizes are that split's pieces times it (nested where several axes cut); None otherwise
    _unit: Optional[int]
    __slots__ = ["_sizes", "_unit"]

    @property
    def _auto(self) -> bool:
        return self._unit is not None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Any call with a ragged input lands here (the subclass is asked first), never in the dispatcher."""
        return _run(func, args, kwargs or {})

    @property
    def sizes(self) -> Sizes:
        return self._sizes

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"RaggedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placement={self.placement}, "
                f"sbp={self.sbp}, sizes={self._sizes}, local={self._local})")

    def __reduce_ex__(self, proto: int):
        raise TypeError("torch.save: a ragged tensor's sizes are data of one step; convert it to a balanced "
                        "split first (x.to_global(placement, gt.split(d)))")

    def to_local(self) -> torch.Tensor:
        return _ToLocal.apply(self)

    def to_global(self, placement: Placement | None = None, sbp: Any = None, grad_sbp: Any = None,
                  sizes: Any = None) -> GlobalTensor:
        """Re-cut (ragged <-> balanced, ragged <-> ragged: one uneven all-to-all), gather or box onwards."""
        if grad_sbp is not None:
            raise ValueError("to_global(grad_sbp): not taken by a ragged tensor (its gradient keeps its sizes)")
        placement = self.placement if placement is None else placement
        if placement != self.placement:
            raise ValueError("to_global(placement): a ragged tensor converts on its own placement; convert it to "
                             "a balanced split (gt.split(d)) first, then move that")
        layout = Layout(placement, normalize_sbp(self.sbp if sbp is None else sbp, placement.ndim))
        return convert(self, layout, sizes)

    def full_tensor(self) -> torch.Tensor:
        return convert(self, Layout(self.placement, (Broadcast(),) * self.placement.ndim), None).full_tensor()


# -- building ---------------------------------------------------------------------------------------
def make(local: torch.Tensor, layout: Layout, shape: Sequence[int], sizes: Sizes,
         requires_grad: bool = False, unit: Optional[int] = None) -> GlobalTensor:
    """The tensor for a layout and sizes: ragged where the layout is, a plain GlobalTensor otherwise.

    `unit`: the ragged split came from a reshape of a balanced one (its sizes are that split's pieces
    times `unit`), not from the user or a grouped op; an op that does not take ragged inputs then converts
    it to the balanced split instead of refusing."""
    shape = tuple(shape)
    if not layout.ragged_axes:
        return GlobalTensor(local, layout, shape, requires_grad=requires_grad)
    layout, sizes = _outer_splits_ragged(layout, shape, sizes)
    r = _wrap(RaggedTensor, local, layout, shape, _tensor_key(layout, shape, local.dtype), requires_grad)
    r._sizes = sizes
    r._unit = unit
    return r


def _cuts(layout: Layout, shape: Sequence[int], sizes: Sizes, coord: Optional[Sequence[int]] = None) -> tuple:
    """Per mesh axis what it does, one form for one cut: (dim, the sizes of the group of `coord` on that
    axis, this rank's by default) for a split or ragged axis, the SBP itself otherwise. A balanced
    split's sizes are spelled out (`split_sizes` of the piece the axes before it leave: the nesting
    `Layout.shard` applies); a ragged axis' are its own (None: known inside each slice only)."""
    p = layout.placement
    if coord is None:
        coord = p.coord(context.current().rank) or p.coord(p.flat_ranks[0])
    left: list = list(shape)
    out = []
    for a, s in enumerate(layout.sbp):
        if not isinstance(s, (Split, Ragged)):
            out.append(s)
            continue
        if isinstance(s, Ragged):
            n = None if sizes is None or sizes[a] is None else tuple(sizes[a])
        else:
            n = None if left[s.dim] is None else tuple(split_sizes(left[s.dim], p.shape[a]))
        out.append((s.dim, n))
        left[s.dim] = None if n is None else n[coord[a]]
    return tuple(out)


def _outer_splits_ragged(layout: Layout, shape: tuple, sizes: Sizes) -> tuple[Layout, Sizes]:
    """One form for one cut: a balanced split of a dim on an axis before one that cuts it ragged (nested
    runs: [G, S, d] of an uneven batch on 2x2, whose outer cut happens to be balanced) is written as
    ragged too, with its balanced sizes, as the reshape that made the runs writes it."""
    outer = {b for a in layout.ragged_axes for b in range(a)
             if type(layout.sbp[b]) is Split and layout.sbp[b].dim == layout.sbp[a].dim}
    if not outer:
        return layout, sizes
    cuts = _cuts(layout, shape, sizes)
    return (Layout(layout.placement, tuple(Ragged(s.dim) if b in outer else s for b, s in enumerate(layout.sbp))),
            tuple(cuts[b][1] if b in outer else n for b, n in enumerate(sizes)))


def check_sizes(sizes: Any, layout: Layout, shape: Sequence[int] | None, arg: str = "sizes",
                nested: bool = False) -> Sizes:
    """`sizes` as one tuple per mesh axis; a flat list stands for the one ragged axis'.

    Checked against the layout's structure (one per rank of a ragged axis, non-negative ints, no other
    axis cutting a ragged dim) and, where the global shape is known, against its dims. `nested`: a
    reshape's runs (`RaggedTensor._unit`), where later ragged axes of a dim cut the piece this rank's
    group of the earlier ones holds (their sizes add up to it).
    """
    axes = layout.ragged_axes
    mesh = layout.placement.shape
    if not axes:
        raise ValueError(f"{arg}: sbp {layout.sbp} has no ragged axis (gt.ragged(d)) for sizes to cut; "
                         "drop sizes or use gt.ragged(d)")
    if sizes is None:
        raise ValueError(f"{arg}: sbp {layout.sbp} has a ragged axis: give its per-rank sizes (one int per rank of "
                         f"mesh axis {axes[0]}, adding up to the dim)")
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.tolist()
    sizes = [int(n) if isinstance(n, np.integer) else n for n in sizes]
    per_axis = len(sizes) == layout.placement.ndim and all(n is None or isinstance(n, (list, tuple)) for n in sizes)
    if len(axes) == 1 and (all(isinstance(n, int) for n in sizes) or layout.placement.ndim == 1 and not per_axis):
        sizes = [sizes if a == axes[0] else None for a in range(layout.placement.ndim)]
    if len(sizes) != layout.placement.ndim:
        raise ValueError(f"{arg}: give one entry per mesh axis ({layout.placement.ndim}), None for the axes that "
                         f"are not ragged; got {sizes!r}")
    out = []
    for a, (s, n) in enumerate(zip(layout.sbp, sizes)):
        if not isinstance(s, Ragged):
            if n is not None:
                raise ValueError(f"{arg}: mesh axis {a} is {s!r}, not ragged, so its entry must be None (got {n!r})")
            out.append(None)
            continue
        if isinstance(n, torch.Tensor):
            n = n.tolist()
        n = tuple(n) if isinstance(n, (list, tuple)) else n
        if not isinstance(n, tuple) or len(n) != mesh[a] or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in n):
            raise ValueError(f"{arg}: mesh axis {a} ({s!r}) has {mesh[a]} ranks, so give {mesh[a]} non-negative "
                             f"ints, one per rank; got {n!r}")
        others = [b for b, t in enumerate(layout.sbp) if b != a and isinstance(t, (Split, Ragged)) and t.dim == s.dim
                  and not (nested and shape is not None and (b < a or isinstance(t, Ragged)))]
        if others:
            raise ValueError(f"sbp: {s!r} on mesh axis {a} and {layout.sbp[others[0]]!r} on axis {others[0]} cut the "
                             "same dim; a ragged dim is cut by one mesh axis only")
        outer = [b for b in range(a) if isinstance(layout.sbp[b], (Split, Ragged)) and layout.sbp[b].dim == s.dim]
        if outer:   # nested: the piece of the outer axes' cuts this rank's group holds
            coord = layout.placement.coord(context.current().rank) or layout.placement.coord(layout.placement.flat_ranks[0])
            piece = shape[s.dim]
            for b in outer:
                piece = out[b][coord[b]] if isinstance(layout.sbp[b], Ragged) else \
                    split_sizes(piece, mesh[b])[coord[b]]
            if sum(n) != piece:
                raise ValueError(f"{arg}: mesh axis {a} cuts the piece of {piece} rows of dim {s.dim} that mesh axes "
                                 f"{outer} leave this rank, but its sizes {list(n)} add up to {sum(n)}")
        elif shape is not None and sum(n) != shape[s.dim]:
            raise ValueError(f"{arg}: {list(n)} add up to {sum(n)}, but dim {s.dim} of the tensor (shape "
                             f"{tuple(shape)}) is {shape[s.dim]}; the sizes must add up to the dim")
        out.append(n)
    return tuple(out)


def local_shape(layout: Layout, shape: Sequence[int], sizes: Sizes, rank: int) -> tuple[int, ...]:
    """The shard `rank` holds: balanced cuts from the layout, ragged ones from `sizes`."""
    coord = layout.placement.coord(rank)
    if coord is None:
        return (0,)
    dims = list(_balanced(layout).local_shape(shape, rank))
    for a in layout.ragged_axes:
        dims[layout.sbp[a].dim] = sizes[a][coord[a]]
    return tuple(dims)


def _balanced(layout: Layout, axis: int | None = None) -> Layout:
    """The layout with Ragged(d) read as Broadcast (every axis, or `axis` only) for the balanced arithmetic."""
    return Layout(layout.placement, tuple(Broadcast() if isinstance(s, Ragged) and axis in (None, a) else s
                                          for a, s in enumerate(layout.sbp)))


def from_local(local: torch.Tensor, layout: Layout, sizes: Any, shape: Sequence[int] | None) -> GlobalTensor:
    """`gt.from_local(..., sizes=)`: one all-gather of (shard shape, sizes) checks that every rank's view of
    the sizes agrees and that each shard holds its rows; the global shape follows."""
    comm = context.current()
    p = layout.placement
    inside = p.coord(comm.rank) is not None
    got = comm.all_gather_object((tuple(local.shape), sizes if not isinstance(sizes, torch.Tensor)
                                  else sizes.tolist()) if inside else None, tuple(range(comm.world_size)))
    views = {r: got[r] for r in p.flat_ranks}
    first = p.flat_ranks[0]
    differ = {r: v[1] for r, v in views.items() if _as_lists(v[1]) != _as_lists(views[first][1])}
    if differ:
        raise ValueError(f"from_local(sizes): the ranks' views of sizes differ (rank {first}: {views[first][1]!r}, "
                         + ", ".join(f"rank {r}: {v!r}" for r, v in differ.items())
                         + "); sizes describe the one global cut and must be the same on every rank")
    norm = check_sizes(sizes, layout, shape, "from_local(sizes)")
    ndims = {len(v[0]) for v in views.values()}
    if len(ndims) != 1:
        raise ValueError(f"from_local(local): shards have different numbers of dims: "
                         f"{ {r: v[0] for r, v in views.items()} }")
    layout.check_shape((0,) * ndims.pop(), "from_local(sbp)")
    if shape is None:  # the other dims as from_local finds them: summed over the axes that split them
        by_rank = {r: v[0] for r, v in views.items()}
        shape = []
        for d in range(len(by_rank[first])):
            ragged = [a for a in layout.ragged_axes if layout.sbp[a].dim == d]
            if ragged:
                shape.append(sum(norm[ragged[0]]))
                continue
            axes = {a for a, s in enumerate(layout.sbp) if isinstance(s, Split) and s.dim == d}
            shape.append(sum(by_rank[r][d] for r in p.flat_ranks
                             if all(c == 0 for a, c in enumerate(p.coord(r)) if a not in axes)))
    shape = tuple(shape)
    for r, (held, _) in views.items():
        want = local_shape(layout, shape, norm, r)
        if held != want:
            axis = layout.ragged_axes[0]
            dim = layout.sbp[axis].dim
            raise ValueError(f"from_local(sizes): rank {r} should hold a shard of shape {want} under sizes "
                             f"{list(norm[axis])} (global {shape}), but holds {held}; its rows of dim {dim} "
                             "must be its entry of sizes")
    if not inside:
        local = local.reshape(-1)[:0]
    return _FromLocal.apply(local.to(device_for(p)), layout, shape, norm)


def _as_lists(v: Any) -> Any:
    return [_as_lists(x) for x in v] if isinstance(v, (list, tuple)) else v


def distribute(full: torch.Tensor, layout: Layout, sizes: Any, requires_grad: bool = False) -> GlobalTensor:
    """`gt.to_global(full, placement, sbp, sizes=)`: each rank keeps its rows; no communication."""
    from_full = layout.placement.coord(context.current().rank) is not None
    norm = check_sizes(sizes, layout, full.shape, "to_global(sizes)")
    layout.check_shape(full.shape)
    t = full.detach().to(device_for(layout.placement))
    if from_full:
        t = convert_local(t, Layout(layout.placement, (Broadcast(),) * layout.placement.ndim),
                          _balanced(layout), tuple(full.shape), context.current())
        t = _take_ragged(t, layout, norm).clone(memory_format=torch.contiguous_format)
    else:
        t = t.new_empty((0,))
    return make(t, layout, full.shape, norm, requires_grad)


def _take_ragged(t: torch.Tensor, layout: Layout, sizes: Sizes) -> torch.Tensor:
    coord = layout.placement.coord(context.current().rank)
    for a in layout.ragged_axes:
        t = _recut.take(t, layout.sbp[a].dim, sizes[a], coord[a])
    return t


# -- conversions ------------------------------------------------------------------------------------
def convert(x: GlobalTensor, dst: Layout, sizes: Any, unit: Optional[int] = None) -> GlobalTensor:
    """x in layout `dst` (with `sizes` for its ragged axes); differentiable, the backward the reverse.
    `unit`: the sizes are a reshape's runs (`RaggedTensor._unit`, taken from the tensor they came from)."""
    out = _convert(x, dst, sizes, nested=unit is not None, unit=unit)
    if unit is not None and isinstance(out, RaggedTensor) and out is not x:
        out._unit = unit
    return out


def _convert(x: GlobalTensor, dst: Layout, sizes: Any, nested: bool = False, unit: Optional[int] = None) -> GlobalTensor:
    if dst.ragged_axes:
        sizes = check_sizes(sizes, dst, x.shape, "to_global(sizes)", nested)
    elif sizes is not None:
        check_sizes(sizes, dst, x.shape, "to_global(sizes)")  # raises: nothing to cut
    if dst == x._layout and sizes == getattr(x, "_sizes", None):
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _Convert.apply(x, dst, sizes, unit)
    return _convert_now(x, dst, sizes, unit)


def _convert_now(x: GlobalTensor, dst: Layout, sizes: Sizes, unit: Optional[int] = None) -> GlobalTensor:
    """Axis by axis: the ragged axes re-cut, gathered or sliced; everything else boxed as usual.

    First every ragged axis of x that dst does not keep as it is becomes dst's (ragged -> ragged,
    ragged -> balanced: re-cut; ragged -> Broadcast: gather) or, if dst wants anything else there,
    a balanced split the planner takes on from. Then the non-ragged rest is boxed (one plan), with
    the axes that dst wants ragged taken as balanced splits (or Broadcast), and re-cut (or sliced).
    """
    a = _inner_swap(x._layout, getattr(x, "_sizes", None), dst, sizes, tuple(x.shape))
    if a is not None:  # one axis from rows of d to a split of another dim, or back: one all-to-all in its groups
        comm, p, shape = context.current(), x.placement, tuple(x.shape)
        s, t = x._layout.sbp[a], dst.sbp[a]
        local = x._local
        if p.coord(comm.rank) is not None:
            run = unit if unit is not None else getattr(x, "_unit", None)

            def cuts(q: int) -> tuple:   # (source, target) sizes on axis a of rank q's group
                return (_axis_sizes(x._layout, shape, getattr(x, "_sizes", None), run, q, a),
                        _axis_sizes(dst, shape, sizes, run, q, a))
            # as the planner does for balanced splits: no collective where nothing changes hands on any rank
            moves = any(_recut.moves(*cuts(q)) for q in p.flat_ranks if p.coord(q)[a] == 0)
            local = _recut.swap(local, s.dim, *cuts(comm.rank)[:1], t.dim, cuts(comm.rank)[1],
                                p.group(comm.rank, a), comm, moves)
        return make(local, dst, shape, sizes if dst.ragged_axes else None)
    if unit is not None and (len(x._layout.ragged_axes) > 1 or len(dst.ragged_axes) > 1) and _runs_of(x, unit) \
            and _runs_of_layout(dst, sizes, tuple(x.shape), unit):
        return _exchange_runs(x, dst, sizes, unit)   # nested runs re-cut on several axes at once
    if isinstance(x, RaggedTensor) and x._auto and len(x._layout.ragged_axes) > 1:  # a reshape's nested runs
        x = _balance(x)
    comm = context.current()
    shape = tuple(x.shape)
    p = x.placement
    coord = p.coord(comm.rank)
    local, sbp = x._local, list(x._layout.sbp)
    have = list(getattr(x, "_sizes", None) or (None,) * p.ndim)
    kept = [a for a in x._layout.ragged_axes if dst.sbp[a] == x._layout.sbp[a] and sizes[a] == have[a]]
    unknown = [a for a in x._layout.ragged_axes if have[a] is None and a not in kept]
    if unknown:
        raise ValueError(f"to_global: mesh axis {unknown[0]} of {x._layout.sbp} is ragged with sizes known only inside "
                         "each slice (gt.by_expert's rows on EP x DP); take them back with gt.by_group")
    for a, s in enumerate(x._layout.sbp):
        if not isinstance(s, Ragged) or (dst.sbp[a] == s and sizes[a] == have[a]):
            continue
        d, want = s.dim, dst.sbp[a]
        if coord is not None:
            group = p.group(comm.rank, a)
            if isinstance(want, Broadcast):
                local = _recut.gather(local, d, have[a], group, comm)
            elif _swaps(x._layout, dst, a):   # rows of d -> a split of another dim: one all-to-all
                local = _recut.swap(local, d, have[a], want.dim, split_sizes(shape[want.dim], p.shape[a]), group, comm)
            else:
                to = sizes[a] if isinstance(want, Ragged) and want.dim == d else split_sizes(shape[d], p.shape[a])
                local = _recut.recut(local, d, have[a], to, group, comm)
        if isinstance(want, Broadcast):
            sbp[a], have[a] = Broadcast(), None
        elif _swaps(x._layout, dst, a):
            sbp[a], have[a] = want, None
        elif isinstance(want, Ragged) and want.dim == d:
            sbp[a], have[a] = want, sizes[a]
        else:
            sbp[a], have[a] = Split(d), None
    now = Layout(p, tuple(sbp))
    if now.ragged_axes and now != dst and _boxes_beside(now, dst):
        if coord is not None:  # every rank of a changing axis' group holds the same rows: box the shards
            rows = [local.shape[now.sbp[a].dim] if a in now.ragged_axes else None for a in range(p.ndim)]
            lshape = tuple(next((r for a, r in enumerate(rows) if r is not None and now.sbp[a].dim == d), n)
                           for d, n in enumerate(shape))
            local = convert_local(local, _balanced(now), _balanced(dst), lshape, comm)
        now = dst
    if now.ragged_axes and any(not isinstance(s, Ragged) and s != t for s, t in zip(now.sbp, dst.sbp)):
        raise ValueError(f"to_global: from {x._layout.sbp} to {dst.sbp}: the axes that stay ragged must be the only "
                         "ragged axes; convert the ragged axes first, then the others")
    if not now.ragged_axes:  # the rest is ordinary boxing, with dst's ragged axes first balanced
        mid = Layout(p, tuple(_entry(s, t, now, dst, a) for a, (s, t) in enumerate(zip(now.sbp, dst.sbp))))
        if mid != now:
            local = convert_local(local, now, mid, shape, comm) if coord is not None else local
        for a in dst.ragged_axes:
            d = dst.sbp[a].dim
            if coord is not None:
                if isinstance(mid.sbp[a], Split) and mid.sbp[a].dim != d:   # a split of another dim -> rows of d
                    e = mid.sbp[a].dim
                    local = _recut.swap(local, e, split_sizes(shape[e], p.shape[a]), d, sizes[a],
                                        p.group(comm.rank, a), comm)
                elif isinstance(mid.sbp[a], Split):
                    local = _recut.recut(local, d, split_sizes(shape[d], p.shape[a]), sizes[a],
                                         p.group(comm.rank, a), comm)
                else:
                    local = _recut.take(local, d, sizes[a], coord[a])
            have[a] = sizes[a]
        now = dst
    return make(local if coord is not None else x._local, now, shape,
                tuple(have) if now.ragged_axes else None)


def boundary_cut(x: GlobalTensor, sbp: tuple, hint: Optional[tuple], arrived: Any) -> tuple:
    """A module boundary's target (`globaltensor/module.py`): (x, sbp, sizes, unit) for the layout `sbp` (the
    hint over x's own, its None entries kept). A `gt.ragged(d)` entry of the hint takes the cut the module's
    input `arrived` in ((sbp, sizes, unit): its sizes where it was ragged, a balanced split where it was
    split); x's own ragged axes keep x's sizes. Where a kept ragged axis would sit in an outer cut that
    changes (the expert axis first on EP x DP), a reshape's runs take the sizes their unit gives that layout;
    anything else takes the balanced splits (x balanced first: rows move). sizes None: not ragged."""
    sizes = list(getattr(x, "sizes", None) or (None,) * len(sbp))
    unit = getattr(x, "_unit", None)
    if hint is not None and any(isinstance(h, Ragged) for h in hint):
        have, have_sizes, unit = arrived if arrived is not None else ((None,) * len(sbp), None, None)
        sbp = list(sbp)
        for a, h in enumerate(hint):
            if not isinstance(h, Ragged):
                continue
            if isinstance(have[a], Ragged) and have_sizes is not None:
                sizes[a] = have_sizes[a]
            elif isinstance(have[a], Split):
                sbp[a] = Split(h.dim)
            else:
                raise ValueError(f"{h!r} on mesh axis {a} takes the cut the module's input arrived in there, but it "
                                 f"arrived {have[a]!r} (not split)")
        sbp = tuple(sbp)
    sizes = tuple(n if isinstance(s, Ragged) else None for s, n in zip(sbp, sizes))
    if not any(n is not None for n in sizes):
        return x, sbp, None, None
    if _one_cut(x.sbp, sbp, hint):
        return x, sbp, sizes, unit
    runs = unit if unit is not None else arrived[2] if arrived is not None else None
    cut = {t.dim for t in sbp if isinstance(t, Ragged)}
    as_runs = tuple(Ragged(t.dim) if type(t) is Split and t.dim in cut else t for t in sbp)
    again = None if runs is None else runs_sizes(Layout(x.placement, as_runs), x.shape, runs)
    if again is not None:
        return x, as_runs, again, runs
    if isinstance(x, RaggedTensor):
        x = x.to_global(x.placement, _balanced_sbp(x._layout))
    return x, tuple(o if h is None else Split(h.dim) if isinstance(h, Ragged) else h
                    for h, o in zip(hint or (None,) * len(sbp), x.sbp)), None, None


def _one_cut(have: tuple, sbp: tuple, hint: Optional[tuple]) -> bool:
    """Whether a ragged target keeps one cut its sizes describe: no split of a dim after a ragged axis of it,
    and each ragged axis kept from the tensor (not named by the hint) inside the same outer cuts as before."""
    for a, s in enumerate(sbp):
        if not isinstance(s, Ragged):
            continue
        if any(isinstance(t, Split) and t.dim == s.dim for t in sbp[a + 1:]):
            return False
        named = hint is not None and hint[a] is not None
        if not named and any(sbp[b] != have[b] and any(isinstance(t, (Split, Ragged)) and t.dim == s.dim
                                                       for t in (sbp[b], have[b])) for b in range(a)):
            return False
    return True


def _boxes_beside(now: Layout, dst: Layout) -> bool:
    """Ragged axes that stay as they are, and other axes whose change cuts no ragged dim (a tensor-parallel
    Partial of ragged rows reduced over the tensor axis): ordinary boxing of the shards, with the ragged
    axes read as Broadcast and the ragged dims at this rank's rows, which its axis group shares."""
    ragged_dims = {now.sbp[a].dim for a in now.ragged_axes}
    return all(s == t if isinstance(s, Ragged) or isinstance(t, Ragged) else
               not (isinstance(t, Split) and t.dim in ragged_dims) for s, t in zip(now.sbp, dst.sbp))


def _entry(src: Any, want: Any, layout: Layout, dst: Layout, axis: int) -> Any:
    """What the boxing before the re-cut must reach on one axis: dst's balanced stand-in for Ragged(d)
    (Split(d), or a split of another dim this axis alone cuts, which one all-to-all swaps for the rows,
    or Broadcast from a Broadcast or Partial source, which then needs only a slice)."""
    if not isinstance(want, Ragged):
        return want
    if isinstance(src, Split) and (src.dim == want.dim or _alone(layout, axis, src.dim) and _alone(dst, axis, src.dim)):
        return src
    return Broadcast()


def _alone(layout: Layout, axis: int, dim: int) -> bool:
    """Whether mesh `axis` is the only one of `layout` that cuts `dim`."""
    return all(a == axis or not isinstance(s, (Split, Ragged)) or s.dim != dim for a, s in enumerate(layout.sbp))


def _axis_sizes(layout: Layout, shape: tuple, sizes: Sizes, unit: Optional[int], rank: int, axis: int) -> tuple:
    """The sizes `axis` cuts its dim in for `rank`'s group: a balanced split's (the axis alone on its dim), a
    reshape's runs' from their unit (nested runs differ between groups), else the tensor's own."""
    s = layout.sbp[axis]
    if type(s) is Split:
        return tuple(split_sizes(shape[s.dim], layout.placement.shape[axis]))
    if unit is not None and runs_sizes(layout, shape, unit) == sizes:
        return runs_sizes(layout, shape, unit, rank)[axis]
    return sizes[axis]


def _inner_swap(src: Layout, src_sizes: Sizes, dst: Layout, dst_sizes: Sizes, shape: tuple) -> Optional[int]:
    """The one mesh axis on which src and dst differ, where one side holds rows of d on it (the innermost
    of that side's ragged axes: nested runs stay runs of the same outer pieces) and the other a balanced
    split of another dim that no other axis cuts; every other axis (and its sizes) alike. None otherwise."""
    if src.placement != dst.placement or any(src_sizes is None or src_sizes[a] is None for a in src.ragged_axes) or \
            any(dst_sizes is None or dst_sizes[a] is None for a in dst.ragged_axes):
        return None   # sizes known inside each slice only (by_expert's rows on EP x DP): not re-cut here
    src_cuts, dst_cuts = _cuts(src, shape, src_sizes), _cuts(dst, shape, dst_sizes)
    differ = [a for a in range(src.placement.ndim) if src_cuts[a] != dst_cuts[a]]
    if len(differ) != 1:
        return None
    (a,) = differ
    s, t = src.sbp[a], dst.sbp[a]
    for rows, cut, side in ((s, t, src), (t, s, dst)):
        if isinstance(rows, Ragged) and type(cut) is Split and cut.dim != rows.dim and a == max(side.ragged_axes) \
                and _alone(src, a, cut.dim) and _alone(dst, a, cut.dim):
            return a
    return None


def _swaps(src: Layout, dst: Layout, axis: int) -> bool:
    """Whether `axis` goes from rows of one dim to a balanced split of another that no other axis cuts,
    in either layout: one all-to-all (`boxing/ragged.py`'s swap)."""
    s, t = src.sbp[axis], dst.sbp[axis]
    return isinstance(s, Ragged) and type(t) is Split and t.dim != s.dim and _alone(src, axis, t.dim) and \
        _alone(dst, axis, t.dim)


class _Convert(torch.autograd.Function):
    """The gradient goes back the reverse way: into the source's (dual) layout and sizes."""

    @staticmethod
    def forward(ctx, x: GlobalTensor, dst: Layout, sizes: Sizes, unit: Optional[int] = None) -> GlobalTensor:  # type: ignore[override]
        ctx.src, ctx.sizes = grad_layout(x._layout), getattr(x, "_sizes", None)
        ctx.unit = getattr(x, "_unit", None)
        return _convert_now(x, dst, sizes, unit)

    @staticmethod
    def backward(ctx, grad: GlobalTensor):  # type: ignore[override]
        unit = ctx.unit if ctx.unit is not None else getattr(grad, "_unit", None)   # the runs either side is cut in
        if ctx.unit is not None and len(ctx.src.ragged_axes) > 1 and \
                _inner_swap(grad._layout, getattr(grad, "_sizes", None), ctx.src, ctx.sizes, tuple(grad.shape)) is None \
                and not _runs_of(grad, ctx.unit):
            # a reshape's nested runs: by way of the balanced split
            balanced = _convert_now(grad, Layout(ctx.src.placement, _balanced_sbp(ctx.src)), None)
            return _unbalance(balanced, ctx.src, ctx.unit), None, None, None
        out = _convert_now(grad, ctx.src, ctx.sizes, unit)
        if ctx.unit is not None and isinstance(out, RaggedTensor):
            out._unit = ctx.unit   # still a reshape's runs: ops that do not keep them balance them
        return out, None, None, None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout, shape: tuple, sizes: Sizes) -> GlobalTensor:  # type: ignore[override]
        ctx.layout, ctx.sizes = grad_layout(layout), sizes
        return make(local.view_as(local), layout, shape, sizes)

    @staticmethod
    def backward(ctx, grad: GlobalTensor):  # type: ignore[override]
        if grad._layout != ctx.layout or getattr(grad, "_sizes", None) != ctx.sizes:
            grad = _convert_now(grad, ctx.layout, ctx.sizes)
        return grad._local, None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: RaggedTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.layout, ctx.shape, ctx.sizes = grad_layout(x._layout), tuple(x.shape), x._sizes
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return make(grad, ctx.layout, ctx.shape, ctx.sizes)


# -- ops on ragged inputs ---------------------------------------------------------------------------
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}
_SUMS = {aten.sum.default, aten.sum.dim_IntList}


def _is_pointwise(func: Any) -> bool:
    rule = RULES.get(func)
    return rule is not None and rule.meta in (elementwise_meta, cast_meta)


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    flat, _ = tree_flatten((args, kwargs))
    ragged = [t for t in flat if isinstance(t, RaggedTensor)]
    first = ragged[0]
    if func in _SUMS:
        return _sum(func, args, kwargs)
    if func in _LIKE or _is_pointwise(func):
        if all(t._auto for t in ragged) and any(_held_axes(t, tuple(first.shape), first._layout) is None for t in flat
                                               if isinstance(t, GlobalTensor) and not isinstance(t, RaggedTensor)):
            return _on_balanced(func, args, kwargs)   # a reshape's rows meet another split: balanced, then the op
        return _pointwise(func, args, kwargs, flat, first)
    if func is aten.detach.default or func is aten.alias.default:
        return _pointwise(func, args, kwargs, flat, first)
    if func in (aten.unsqueeze.default, aten.expand.default) and args[0] is first and len(ragged) == 1:
        return _new_dims(func, args, kwargs)
    auto = all(t._auto for t in ragged)
    out = _NOT_TAKEN
    if auto:  # a reshape's ragged rows: a Linear's reshapes, permutations and products keep them
        if func in _RESHAPES and args[0] is first and len(ragged) == 1:
            out = _reshape(func, args, kwargs)
        elif func in _PERMUTES and len(ragged) == 1:
            out = _permute(func, args, kwargs)
        elif func in _MATMULS:
            out = _mm(func, args, kwargs)
    if out is _NOT_TAKEN:
        out = _by_rule(func, args, kwargs, ragged)
    if out is not _NOT_TAKEN:
        return out
    if auto:  # ops that do not keep a reshape's rows get them balanced
        return _on_balanced(func, args, kwargs)
    at = next(i for i, t in enumerate(t for t in flat if isinstance(t, torch.Tensor)) if t is first)
    # NotImplementedError, not TypeError: torch turns a TypeError inside `x @ w` into "unsupported operand"
    raise NotImplementedError(f"{func}: tensor input {at} is ragged ({first._layout.sbp}, sizes {_shown(first._sizes)}); "
                    "ragged tensors are taken by ops that work along other dims (their rule passes a split of the "
                    "ragged dim through), sums, conversions and the grouped ops (gt.grouped_linear); convert it "
                    "to a balanced split first: "
                    f"x.to_global(x.placement, {_balanced_sbp(first._layout)})")


# -- reshapes, permutations and matrix products of ragged rows (what a Linear over [G, S, d] runs) -----
_NOT_TAKEN = object()
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.flatten.using_ints,
             aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default}
_PERMUTES = {aten.t.default, aten.transpose.int, aten.permute.default}
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


def _meta_shape(func: Any, args: tuple, kwargs: dict) -> tuple:
    meta = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor)
                    else t, (args, kwargs))
    return tuple(func(*meta[0], **meta[1]).shape)


def _inside(layout: Layout) -> bool:
    return layout.placement.coord(context.current().rank) is not None


def _nested(length: int, p: Placement, axes: Sequence[int], coord: Sequence[int]) -> list:
    """Per mesh axis the sizes of the group of `coord` on that axis when `axes` split `length` in turn (each
    cutting the piece the ones before it left, balanced); None on the other axes."""
    cuts = _cuts(_splitting(p, axes), (length,), None, coord)
    return [cuts[a][1] if a in axes else None for a in range(p.ndim)]


def _splitting(p: Placement, axes: Sequence[int]) -> Layout:
    """The layout in which mesh `axes` split dim 0 (in mesh order, balanced) and the others broadcast."""
    return Layout(p, tuple(Split(0) if a in axes else Broadcast() for a in range(p.ndim)))


def _unit_sizes(length: int, unit: int, p: Placement, axes: Sequence[int], coord: Optional[Sequence[int]] = None) -> Sizes:
    """`_nested` in units of `unit` rows: the sizes of a reshape's runs (this rank's view by default)."""
    coord = coord or p.coord(context.current().rank) or p.coord(p.flat_ranks[0])
    return tuple(None if n is None else tuple(k * unit for k in n) for n in _nested(length, p, axes, coord))


def _is_balanced(length: int, unit: int, p: Placement, axes: Sequence[int]) -> bool:
    """Whether `length` cut by `axes` in units of `unit` rows is the balanced cut of its rows, on every rank."""
    return all([None if n is None else tuple(k * unit for k in n) for n in _nested(length, p, axes, c)] ==
               _nested(length * unit, p, axes, c) for c in map(p.coord, p.flat_ranks))


def _members(p: Placement, axes: Sequence[int], coord: Sequence[int]) -> list:
    """The coordinates that differ from `coord` on `axes` only, in mesh order (their runs of a dim those
    axes cut lie in this order)."""
    out = [tuple(coord)]
    for a in axes:
        out = [c[:a] + (i,) + c[a + 1:] for c in out for i in range(p.shape[a])]
    return out


def _rows(length: int, p: Placement, axes: Sequence[int], coord: Sequence[int]) -> int:
    return _splitting(p, axes).local_shape((length,), p.rank_at(coord))[0]


def _recut_units(local: torch.Tensor, p: Placement, axes: Sequence[int], d: int, length: int, unit: int,
                 to_units: bool) -> torch.Tensor:
    """Balanced rows of dim d <-> the same axes' cut in units (one uneven all-to-all over the ranks the axes
    span: every rank's run is one contiguous range in their mesh order, nested cuts included)."""
    comm = context.current()
    members = _members(p, axes, p.coord(comm.rank))
    units = [_rows(length, p, axes, c) * unit for c in members]
    rows = [_rows(length * unit, p, axes, c) for c in members]
    src, dst = (rows, units) if to_units else (units, rows)
    return _recut.recut(local, d, src, dst, [p.rank_at(c) for c in members], comm)


def runs_sizes(layout: Layout, shape: Sequence[int], unit: int, rank: Optional[int] = None) -> Optional[Sizes]:
    """The sizes of a reshape's runs in units of `unit` rows under `layout` (its ragged axes on one dim, in
    turn, as `uneven_merge` makes them), as `rank` (this rank by default) sees them; None where that is not
    such a layout."""
    dims = {layout.sbp[a].dim for a in layout.ragged_axes}
    if len(dims) != 1 or shape[next(iter(dims))] % unit or layout.has_partial:
        return None
    (d,) = dims
    if any(type(s) is Split and s.dim == d for s in layout.sbp):
        return None
    coord = None if rank is None else layout.placement.coord(rank)
    return _unit_sizes(shape[d] // unit, unit, layout.placement, layout.ragged_axes, coord)


def _runs_of_layout(layout: Layout, sizes: Sizes, shape: tuple, unit: int) -> bool:
    return not layout.ragged_axes and not layout.has_partial or runs_sizes(layout, shape, unit) == sizes


def _runs_of(x: GlobalTensor, unit: int) -> bool:
    """Whether x is balanced (no Partial) or a reshape's runs in units of `unit`: every rank's block is known."""
    if isinstance(x, RaggedTensor):
        return x._unit == unit and _runs_of_layout(x._layout, x._sizes, tuple(x.shape), unit)
    return not x._layout.has_partial


def _box_at(layout: Layout, shape: tuple, unit: int, rank: int) -> Optional[tuple]:
    """The block `rank` holds of a tensor balanced or cut in runs of `unit` rows (`runs_sizes`)."""
    p = layout.placement
    coord = p.coord(rank)
    if coord is None:
        return None
    box = list(_balanced(layout).shard(shape, rank))
    if layout.ragged_axes:
        d = layout.sbp[layout.ragged_axes[0]].dim
        sizes = _unit_sizes(shape[d] // unit, unit, p, layout.ragged_axes, coord)
        for a in layout.ragged_axes:
            start, _ = box[d]
            box[d] = (start + sum(sizes[a][:coord[a]]), sizes[a][coord[a]])
    return tuple(box)


def _exchange_runs(x: GlobalTensor, dst: Layout, sizes: Sizes, unit: int) -> GlobalTensor:
    """x (balanced, or a reshape's runs) in `dst` (the same unit's runs, or balanced), where several mesh axes
    change at once (the expert axis first on EP x DP: nested runs -> experts split and the runs re-cut over
    the other axis): every rank's block on both sides follows from the structure, so each receives exactly
    what its target block holds and its source block does not, point to point, from the rank that holds it
    alike on the source's Broadcast axes."""
    comm = context.current()
    p, shape, rank = x.placement, tuple(x.shape), comm.rank
    src, out = x._layout, dst
    if p.coord(rank) is None:
        return make(x._local, dst, shape, sizes if dst.ragged_axes else None)
    whole = [a for a, s in enumerate(src.sbp) if isinstance(s, Broadcast)]

    def alike(q: int) -> bool:
        return all(p.coord(q)[a] == p.coord(rank)[a] for a in whole)
    mine, want = _box_at(src, shape, unit, rank), _box_at(out, shape, unit, rank)
    sends, recvs, pieces = {}, {}, []
    for q in p.flat_ranks:
        if q == rank:
            continue
        if alike(q):
            give = intersect(mine, _box_at(out, shape, unit, q))
            if numel(give):
                sends[q] = slice_box(x._local, relative(give, mine)).contiguous()
            take = intersect(_box_at(src, shape, unit, q), want)
            if numel(take):
                recvs[q] = (tuple(n for _, n in take), x._local.dtype)
                pieces.append((q, take))
    local = x._local.new_empty(tuple(n for _, n in want))
    own = intersect(mine, want)
    if numel(own):
        slice_box(local, relative(own, want)).copy_(slice_box(x._local, relative(own, mine)))
    key = zlib.crc32(repr((src, dst, shape, "runs")).encode()) or 1
    got = comm.exchange(sends, recvs, None, x._local.device, key)
    for q, box in pieces:
        slice_box(local, relative(box, want)).copy_(got[q])
    return make(local, dst, shape, sizes if dst.ragged_axes else None)


def _balance(x: "RaggedTensor") -> GlobalTensor:
    """A reshape's ragged tensor on the balanced split of its dim (one uneven all-to-all, nothing where the
    runs already are the balanced ones)."""
    axes = x._layout.ragged_axes
    d, p = x._layout.sbp[axes[0]].dim, x.placement
    layout = Layout(p, tuple(Split(d) if a in axes else s for a, s in enumerate(x._layout.sbp)))
    local = x._local
    if _inside(layout):
        local = _recut_units(local, p, axes, d, x.shape[d] // x._unit, x._unit, to_units=False)
    return make(local, layout, tuple(x.shape), None)


def _unbalance(y: GlobalTensor, layout: Layout, unit: int) -> GlobalTensor:
    """The reverse of `_balance`: y (Split(d) where `layout` is ragged) back to the runs in units."""
    axes = layout.ragged_axes
    d, p = layout.sbp[axes[0]].dim, layout.placement
    local = y._local
    if _inside(layout):
        local = _recut_units(local, p, axes, d, y.shape[d] // unit, unit, to_units=True)
    return make(local, layout, tuple(y.shape), _unit_sizes(y.shape[d] // unit, unit, p, axes), unit=unit)


def _reshaped(x: GlobalTensor, layout: Layout, shape: tuple, length: int, unit: int) -> GlobalTensor:
    """x's shard read in `shape` under `layout`, its ragged dim `length` units of `unit` rows (no data moves)."""
    p = layout.placement
    sizes = _unit_sizes(length, unit, p, layout.ragged_axes) if layout.ragged_axes else None
    local = x._local
    if _inside(layout):
        local = local.reshape(local_shape(layout, shape, sizes, context.current().rank) if sizes else
                              layout.local_shape(shape, context.current().rank))
    return make(local, layout, shape, sizes, unit=unit if sizes else None)


def merged_view(func: Any, args: tuple, kwargs: dict) -> GlobalTensor:
    """A reshape that merges an unevenly split dim with the dims inside it ([G, S, d] S(0) -> [G*S, d], G not
    a multiple of the ranks): the output is ragged on the merged dim, its sizes the pieces times the inner
    size (`ops/view.py`'s uneven_merge); no data moves. Run by the reshape rule's decomposition."""
    x = args[0]
    ins, outs = tuple(x.shape), _meta_shape(func, args, kwargs)
    axes, d, o, unit = _view.uneven_merge(ins, outs, x._layout)
    carried = _view.reshape_map(ins, outs, x.placement.shape)
    cut = Split(o) if _is_balanced(ins[d], unit, x.placement, axes) else Ragged(o)
    sbp = tuple(cut if a in axes else Split(carried[s.dim]) if isinstance(s, Split) else s
                for a, s in enumerate(x._layout.sbp))
    return _reshaped(x, Layout(x.placement, sbp), outs, ins[d], unit)


def _reshape(func: Any, args: tuple, kwargs: dict) -> Any:
    """A reshape of a reshape's ragged rows: the ragged dim, the outer one of its reshape group, carries to
    the outer output dim of the group in units scaled by the inner sizes' ratio ([G*S, d] ragged ->
    [G, S, d] ragged on G, or balanced S(0) where the runs are the balanced ones); other axes broadcast or
    split dims the reshape carries balanced. Anything else is not taken."""
    x = args[0]
    ins, outs = tuple(x.shape), _meta_shape(func, args, kwargs)
    axes = x._layout.ragged_axes
    d = x._layout.sbp[axes[0]].dim
    carried = _view.reshape_map(ins, outs, x.placement.shape)
    if any(not isinstance(s, (Split, Broadcast, Ragged)) or isinstance(s, Split) and s.dim not in carried
           or isinstance(s, Ragged) and s.dim != d for s in x._layout.sbp):
        return _NOT_TAKEN
    for gi, gj in _view.reshape_groups(ins, outs):
        if d not in gi:
            continue
        at = gi.index(d)
        big = [k for k in gj if outs[k] != 1]
        if any(ins[k] != 1 for k in gi[:at]) or not big or any(
                isinstance(s, Split) and s.dim in gi for s in x._layout.sbp):
            return _NOT_TAKEN
        o = big[0]
        inner_in = int(np.prod([ins[k] for k in gi[at + 1:]]))
        inner_out = int(np.prod([outs[k] for k in gj[gj.index(o) + 1:]]))
        if (x._unit * inner_in) % inner_out:
            return _NOT_TAKEN
        unit, length = x._unit * inner_in // inner_out, ins[d] // x._unit
        cut = Split(o) if _is_balanced(length, unit, x.placement, axes) else Ragged(o)
        sbp = tuple(cut if a in axes else Split(carried[s.dim]) if isinstance(s, Split) else s
                    for a, s in enumerate(x._layout.sbp))
        return _reshaped(x, Layout(x.placement, sbp), outs, length, unit)
    return _NOT_TAKEN


def _permute(func: Any, args: tuple, kwargs: dict) -> Any:
    """t, transpose, permute: the cut dims move with their dims, sizes unchanged."""
    x = args[0]
    n = x.dim()
    if not isinstance(x, RaggedTensor):
        return _NOT_TAKEN
    perm = list(range(n))
    if func is aten.t.default:
        perm = perm[::-1]
    elif func is aten.permute.default:
        perm = [p % n for p in (args[1] if len(args) > 1 else kwargs["dims"])]
    else:
        a, b = (args[1] if len(args) > 1 else kwargs["dim0"]) % n, (args[2] if len(args) > 2 else kwargs["dim1"]) % n
        perm[a], perm[b] = perm[b], perm[a]
    where = {src: dst for dst, src in enumerate(perm)}
    sbp = tuple(type(s)(where[s.dim]) if isinstance(s, (Split, Ragged)) else s for s in x._layout.sbp)
    local = func(x._local, *args[1:], **kwargs) if _inside(x._layout) else x._local
    return make(local, Layout(x.placement, sbp), tuple(x.shape[p] for p in perm), x._sizes, unit=x._unit)


def _mm(func: Any, args: tuple, kwargs: dict) -> Any:
    """Matrix products with ragged rows: rows @ whole -> rows (mm, bmm, addmm with a whole bias), whole @
    ragged columns -> ragged columns, and a product over the ragged dim of two operands cut alike
    (x.t() @ grad: a Linear's weight gradient) -> Partial on the ragged axes. Every other mesh axis
    broadcasts, or (bmm) splits the batch dim of every operand alike (experts split over an expert axis)."""
    if func is aten.addmm.default:
        bias, a, b = args[:3]
        if isinstance(bias, RaggedTensor):
            return _NOT_TAKEN
    else:
        bias, (a, b) = None, args[:2]
    off = 1 if func is aten.bmm.default else 0
    ra, rb = isinstance(a, RaggedTensor), isinstance(b, RaggedTensor)
    first = a if ra else b
    layout, p = first._layout, first.placement
    axes = layout.ragged_axes
    others = tuple(s for k, s in enumerate(layout.sbp) if k not in axes)
    if any(not (isinstance(s, Broadcast) or off and s == Split(0)) for s in others):
        return _NOT_TAKEN
    for t in (bias, a, b):
        if not isinstance(t, GlobalTensor):
            continue
        if t.placement != p or tuple(s for k, s in enumerate(t._layout.sbp) if k not in axes) != others:
            return _NOT_TAKEN
        if not isinstance(t, RaggedTensor) and not all(isinstance(t._layout.sbp[k], Broadcast) for k in axes):
            return _NOT_TAKEN
    if bias is not None and bias.dim() == 2 and bias.shape[0] != 1:
        return _NOT_TAKEN   # a bias with a row per ragged row: not a Linear's
    dim_a = a._layout.sbp[axes[0]].dim if ra else None
    dim_b = b._layout.sbp[axes[0]].dim if rb else None
    shape = tuple(a.shape[:off]) + (a.shape[off], b.shape[off + 1])
    if ra and rb:
        if dim_a != off + 1 or dim_b != off or a._sizes != b._sizes or a._unit != b._unit or bias is not None \
                or a._layout.ragged_axes != b._layout.ragged_axes:
            return _NOT_TAKEN
        out_sbp, sizes, unit = Partial(), None, None
    elif (ra and dim_a == off + 1 or rb and dim_b == off) and bias is None:  # over the ragged dim, the other whole
        out_sbp, sizes, unit = Partial(), None, None
        whole = 1 if ra else 0
    elif ra and dim_a == off:
        out_sbp, sizes, unit = Ragged(off), a._sizes, a._unit
    elif rb and dim_b == off + 1 and bias is None:
        out_sbp, sizes, unit = Ragged(off + 1), b._sizes, b._unit
    else:
        return _NOT_TAKEN
    out = Layout(p, tuple(out_sbp if k in axes else s for k, s in enumerate(layout.sbp)))
    if _inside(layout):
        largs = [t._local if isinstance(t, GlobalTensor) else t for t in args]
        if isinstance(out_sbp, Partial) and not (ra and rb):  # the whole operand's rows (columns) this rank holds
            coord = p.coord(context.current().rank)
            for k in axes:
                largs[whole] = _recut.take(largs[whole], off + (1 - whole), first._sizes[k], coord[k])
        local = func(*largs, **kwargs)
    else:
        local = first._local.new_empty((0,))
    return make(local, out, shape, sizes, unit=unit)


# -- any op whose rule passes a split of the ragged dim through ------------------------------------
_BY_RULE: dict = {}  # call key -> (rule, ctx, stand-in input layouts, output layouts, cuts) or None


def _by_rule(func: Any, args: tuple, kwargs: dict, ragged: list) -> Any:
    """An op that works along dims other than the ragged one, run on the shards with no data moved.

    Its rule decides as for a balanced split of the ragged dim (the stand-in), taking only a signature
    that needs no boxing: on each ragged axis the ragged inputs keep `S(d)`, the output is `S(o)` with
    dim o as long as d (its rows are the input's rows: the sizes pass through), Partial (each rank's
    rows are a term) or Broadcast (what the rule computes whole from any shard: `new_zeros`), and an input whole there (Broadcast) stays whole, or, where the signature splits
    it along a dim as long as the ragged one, gets this rank's rows (a local slice); on every other axis
    each input stays as it is. Such a signature holds for any cut of d, not only the balanced one. The
    kernel sees the true shards (`_RaggedLocal`: shapes and boxes from the sizes). Not taken (None
    cached) otherwise: the caller balances a reshape's rows or refuses."""
    first = ragged[0]
    p, axes, sizes = first.placement, first._layout.ragged_axes, first._sizes
    length = first.shape[first._layout.sbp[axes[0]].dim]
    tensors: list = []
    map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    for t in ragged:
        if t.placement != p or t._layout.ragged_axes != axes or t._sizes != sizes or \
                t.shape[t._layout.sbp[axes[0]].dim] != length:
            return _NOT_TAKEN
    if any(isinstance(t, GlobalTensor) and t.placement != p for t in tensors):
        return _NOT_TAKEN
    key = _rule_key(func, args, kwargs)
    chosen = _BY_RULE.get(key, _NONE)
    if chosen is _NONE:
        if len(_BY_RULE) >= 4096:   # bounded, as the dispatcher's programs are
            _BY_RULE.clear()
        chosen = _BY_RULE[key] = _choose_passing(func, args, kwargs, tensors, p, axes, length)
    if chosen is None:
        return _NOT_TAKEN
    rule, ctx, stand_ins, out_layouts, cuts, dtypes = chosen
    unit = first._unit if all(t._auto for t in ragged) else None
    if is_inplace(func) and not (isinstance(args[0], RaggedTensor) and out_layouts[0] == stand_ins[0]):
        return _NOT_TAKEN   # writes its target where it is, or not here
    if not _inside(first._layout):
        result = [None if lay is None else first._local.new_empty((0,), dtype=dt) for lay, dt in zip(out_layouts, dtypes)]
        return _wrap_outputs(func, ctx, result, out_layouts, axes, sizes, unit, args)
    rank = context.current().rank
    coord = p.coord(rank)

    def shard(t: Any, i: int) -> Any:
        local = t._local if isinstance(t, GlobalTensor) else t
        for a in axes:  # a whole operand split by the signature along a dim as long as the ragged one
            if cuts[i][a] is not None:
                local = _recut.take(local, cuts[i][a], sizes[a], coord[a])
        return local
    largs, lkwargs = map_tensors(args, kwargs, shard)
    where = _RaggedLocal(ctx, stand_ins, out_layouts, rank, sizes=sizes, axes=axes)
    got = func(*largs, **lkwargs) if rule.local is None else rule.local(func, largs, lkwargs, where)
    if is_inplace(func):
        return args[0]
    result, _ = flatten_out(got)
    for j, (o, lay) in enumerate(zip(result, out_layouts)):
        if lay is not None and tuple(o.shape) != where.out_shape(j):
            raise AssertionError(f"{func}: its kernel gave a shard of shape {tuple(o.shape)} for output {j}, "
                                 f"not the {where.out_shape(j)} that {lay.sbp} with sizes {_shown(sizes)} holds")
    return _wrap_outputs(func, ctx, result, out_layouts, axes, sizes, unit, args, got)


def _wrap_outputs(func, ctx, result, out_layouts, axes, sizes, unit, args, got=None) -> Any:
    """The kernel's shards as global tensors: ragged where the rows passed through, plain where Partial."""
    wrapped = []
    for o, lay, shape in zip(result, out_layouts, ctx.out_shapes):
        if lay is None or o is None:
            wrapped.append(o)
            continue
        if any(isinstance(lay.sbp[a], Split) for a in axes):
            lay = Layout(lay.placement, tuple(Ragged(s.dim) if a in axes else s for a, s in enumerate(lay.sbp)))
            wrapped.append(make(o, lay, shape, sizes, unit=unit))
        else:
            wrapped.append(make(o, lay, shape, None))
    if got is None:
        return wrapped[0] if len(wrapped) == 1 and len(out_layouts) == 1 else tuple(wrapped)
    return flatten_out(got)[1](wrapped)


def _rule_key(func: Any, args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    return (func, spec) + tuple(t._key if isinstance(t, GlobalTensor) else
                                ("plain", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                                for t in leaves)


_NONE = object()


def _choose_passing(func: Any, args: tuple, kwargs: dict, tensors: list, p: Placement, axes: tuple,
                    length: int) -> Optional[tuple]:
    """`_by_rule`'s decision: (rule, ctx, stand-in input layouts, output layouts, per input the dim a
    whole operand is cut along on each ragged axis), or None where no signature passes the rows through."""
    rule = RULES.get(func)
    if rule is None or rule.decompose is not None and rule.decompose_when is None:
        return None
    bcast = Layout(p, (Broadcast(),) * p.ndim)
    srcs = tuple(Layout(p, _balanced_sbp(t._layout)) if isinstance(t, GlobalTensor) else bcast for t in tensors)
    try:
        meta_args, meta_kwargs = map_tensors(args, kwargs, lambda t, i: torch.empty(
            tuple(t.shape), dtype=t.dtype, device="meta"))
        outs, _ = flatten_out(func(*meta_args, **meta_kwargs) if rule.meta is None else
                              rule.meta(func, meta_args, meta_kwargs))
    except Exception as e:
        if data_dependent(e):
            return None
        raise
    ctx = Ctx(func, tuple(tuple(t.shape) for t in tensors), tuple(None if o is None else tuple(o.shape) for o in outs),
              meta_args, meta_kwargs, p.shape)
    if rule.decompose is not None and rule.decompose_when(ctx, srcs):
        return None
    cands = axis_candidates(ctx, rule, len(tensors), len(outs))
    ragged = [isinstance(t, RaggedTensor) for t in tensors]
    per_axis, cut_dims = [], []
    for a in range(p.ndim):
        fits, cuts = [], []
        for ins, outs_sbp in cands:
            cut = _passes(ins, outs_sbp, a, a in axes, srcs, ctx, ragged, length)
            if cut is not None:
                fits.append((ins, outs_sbp))
                cuts.append(cut)
        if not fits:
            return None
        per_axis.append(fits)
        cut_dims.append(cuts)
    best = None
    for pick in itertools.product(*[range(len(f)) for f in per_axis]):
        combo = [per_axis[a][k] for a, k in enumerate(pick)]
        targets = tuple(Layout(p, tuple(sig[0][i] for sig in combo)) for i in range(len(tensors)))
        out_layouts = tuple(None if outs[j] is None else Layout(p, tuple(sig[1][j] for sig in combo))
                            for j in range(len(outs)))
        if any(lay is not None and any(isinstance(lay.sbp[a], Split) for a in axes) and
               not all(isinstance(lay.sbp[a], Split) and lay.sbp[a].dim == lay.sbp[axes[0]].dim for a in axes)
               for lay in out_layouts):
            continue   # an output's rows pass through on every ragged axis alike, or on none
        if rule.kernel_cost is not None and rule.kernel_cost(ctx, srcs, targets, out_layouts) != ((), 0):
            continue   # a kernel that communicates itself (a scan along the split dim) works along it
        partials = sum(lay is not None and lay.has_partial for lay in out_layouts)
        if (best is None or partials < best[0]) and _valid(ctx, rule, targets, out_layouts, p):
            cuts = tuple(tuple(cut_dims[a][k][i] for a, k in enumerate(pick)) for i in range(len(tensors)))
            best = (partials, (rule, ctx, targets, out_layouts, cuts,
                               tuple(None if o is None else o.dtype for o in outs)))
            if not partials:
                break
    return None if best is None else best[1]


def _passes(ins: tuple, outs: tuple, axis: int, is_ragged: bool, srcs: tuple, ctx: Ctx, ragged: list,
            length: int) -> Optional[tuple]:
    """Whether one axis' signature takes the inputs as they are (see `_by_rule`); then per input the dim
    a whole operand is cut along on a ragged axis (None: kept as it is), else None."""
    cuts = []
    for i, (want, src) in enumerate(zip(ins, srcs)):
        have = src.sbp[axis]
        if want == have and (not is_ragged or ragged[i] or isinstance(have, Broadcast)):
            cuts.append(None)
        elif is_ragged and isinstance(have, Broadcast) and isinstance(want, Split) and \
                ctx.shapes[i][want.dim] == length:
            cuts.append(want.dim)
        else:
            return None
    if is_ragged and not any(c is None and r for c, r in zip(cuts, ragged)):
        return None
    if is_ragged and any(o is not None and not (isinstance(o, (Partial, Broadcast)) or isinstance(o, Split) and
                                                ctx.out_shapes[j][o.dim] == length)
                         for j, o in enumerate(outs) if ctx.out_shapes[j] is not None):
        return None
    return tuple(cuts)


@dataclass(frozen=True)
class _RaggedLocal(Local):
    """A kernel's `Local` where the ragged axes cut as the sizes say: the layouts hold the balanced
    stand-ins (Split(d)), the shapes and boxes are the true shards' (a random op draws its true rows)."""
    sizes: Sizes = ()
    axes: tuple = ()

    def out_shape(self, i: int = 0) -> tuple[int, ...]:
        return tuple(n for _, n in self.out_box(i))

    def in_box(self, i: int) -> tuple[tuple[int, int], ...]:
        return self._box(self.in_layouts[i], self.ctx.shapes[i])

    def out_box(self, i: int = 0) -> tuple[tuple[int, int], ...]:
        return self._box(self.out_layouts[i], self.ctx.out_shapes[i])

    def _box(self, layout: Layout, shape: tuple) -> tuple:
        coord = layout.placement.coord(self.rank)
        box = list(Layout(layout.placement, tuple(Broadcast() if a in self.axes else s for a, s in
                                                  enumerate(layout.sbp))).shard(shape, self.rank))
        for a in self.axes:
            s = layout.sbp[a]
            if isinstance(s, Split):
                start, _ = box[s.dim]
                box[s.dim] = (start + sum(self.sizes[a][:coord[a]]), self.sizes[a][coord[a]])
        return tuple(box)


def _on_balanced(func: Any, args: tuple, kwargs: dict) -> Any:
    """The op on its ragged inputs' balanced splits (a reshape's rows, for an op that does not keep them)."""
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        raise NotImplementedError(f"{func}: writes a ragged input in place (the rows of a reshape of an uneven split, "
                                  "which it does not take); the balanced copy it would write is not the tensor: "
                                  "reshape a balanced split first, or write out of place")
    balanced = tree_map(lambda t: _balance(t) if isinstance(t, RaggedTensor) else t, (args, kwargs))
    return func(*balanced[0], **balanced[1])


def _shown(sizes: Sizes) -> Any:
    kept = [list(s) for s in sizes if s is not None]
    return kept[0] if len(kept) == 1 else sizes


def _balanced_sbp(layout: Layout) -> tuple:
    return tuple(Split(s.dim) if isinstance(s, Ragged) else s for s in layout.sbp)


def _pointwise(func: Any, args: tuple, kwargs: dict, flat: list, first: RaggedTensor) -> Any:
    """The op on the shards: ragged operands must share layout and sizes; a Broadcast operand is cut to the
    rows this rank holds (a local slice); the outputs take the first ragged input's layout and sizes."""
    layout, sizes = first._layout, first._sizes
    if layout.has_partial:
        raise TypeError(f"{func}: a ragged input with a Partial axis ({layout.sbp}) is not taken by pointwise ops; "
                        "reduce it first")
    comm = context.current()
    inside = layout.placement.coord(comm.rank) is not None
    shapes = [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]
    shape = shapes[0] if func in _LIKE or is_inplace(func) else tuple(torch.broadcast_shapes(*shapes))

    def local(t: Any) -> Any:
        if isinstance(t, RaggedTensor):
            if t._layout != layout or t._sizes != sizes:
                raise ValueError(f"{func}: ragged inputs of different layouts or sizes ({layout.sbp} sizes "
                                 f"{_shown(sizes)} vs {t._layout.sbp} sizes {_shown(t._sizes)}); convert one to "
                                 "the other's (x.to_global(sbp=..., sizes=...))")
            return t._local
        if isinstance(t, GlobalTensor):
            held = _held_axes(t, shape, layout)
            if held is None:
                raise ValueError(f"{func}: a ragged tensor meets a {t.sbp} one; other operands of a ragged one must "
                                 "be ragged alike or Broadcast on its placement (or split as it is on its other axes)")
            return _cut_operand(func, t._local, tuple(t.shape), shape, layout, sizes, held) if inside else t._local
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return _cut_operand(func, t, tuple(t.shape), shape, layout, sizes) if inside else t
        return t

    largs, lkwargs = tree_map(local, (args, kwargs))
    result = func(*largs, **lkwargs)
    if is_inplace(func):
        return args[0]
    unit = first._unit if all(t._auto for t in flat if isinstance(t, RaggedTensor)) else None
    return tree_map(lambda o: make(o, layout, shape if o.dim() == len(shape) else tuple(first.shape), sizes,
                                   unit=unit) if isinstance(o, torch.Tensor) else o, result)


def _held_axes(t: GlobalTensor, out_shape: tuple, layout: Layout) -> Optional[frozenset]:
    """The mesh axes on which a non-ragged operand of a ragged pointwise op already holds its block (split as
    the ragged tensor is there: a per-expert bias beside rows split by expert); None if some axis of it is
    neither that nor Broadcast."""
    if t.placement != layout.placement:
        return None
    lead = len(out_shape) - t.dim()
    held = set()
    for a, (s, r) in enumerate(zip(t.sbp, layout.sbp)):
        if isinstance(s, Broadcast):
            continue
        if not (isinstance(s, Split) and isinstance(r, Split) and r.dim == s.dim + lead
                and t.shape[s.dim] == out_shape[r.dim]):
            return None
        held.add(a)
    return frozenset(held)


def _cut_operand(func: Any, t: torch.Tensor, t_shape: tuple, out_shape: tuple, layout: Layout,
                 sizes: Sizes, held: frozenset = frozenset()) -> torch.Tensor:
    """A whole operand broadcast against the ragged output: the block of each cut dim it spans (a local slice;
    none on the axes in `held`, where the operand is split alike already)."""
    coord = layout.placement.coord(context.current().rank)
    lead = len(out_shape) - len(t_shape)
    for a, s in enumerate(layout.sbp):
        if not isinstance(s, (Split, Ragged)) or a in held:
            continue
        d = s.dim - lead
        if d < 0 or t_shape[d] == 1:
            continue
        if isinstance(s, Split):  # cut in mesh-axis order, as Layout.shard does
            t = t.narrow(d, *split_range(t.shape[d], layout.placement.shape[a], coord[a]))
        else:
            t = _recut.take(t, d, sizes[a], coord[a])
    return t


def _new_dims(func: Any, args: tuple, kwargs: dict) -> GlobalTensor:
    """unsqueeze and expand (a sum's backward) add dims or widen size-1 ones; the cut dims shift, unchanged."""
    x = args[0]
    ndim = x.dim()
    if func is aten.unsqueeze.default:
        at = args[1] % (ndim + 1)
        moved = [d + (d >= at) for d in range(ndim)]
        shape = tuple(x.shape[:at]) + (1,) + tuple(x.shape[at:])
        local_args = (x._local, at)
    else:
        size = list(args[1] if len(args) > 1 else kwargs["size"])
        lead = len(size) - ndim
        moved = [d + lead for d in range(ndim)]
        shape = tuple(n if n != -1 else x.shape[i - lead] for i, n in enumerate(size))
        for s in x._layout.sbp:
            if isinstance(s, (Split, Ragged)) and shape[s.dim + lead] != x.shape[s.dim]:
                raise TypeError(f"{func}: expands dim {s.dim}, which {s!r} cuts; convert it first")
        cut = {s.dim + lead for s in x._layout.sbp if isinstance(s, (Split, Ragged))}
        local_args = (x._local, [-1 if i in cut else shape[i] for i in range(len(size))])  # size-1 dims widen
    sbp = tuple(type(s)(moved[s.dim]) if isinstance(s, (Split, Ragged)) else s for s in x._layout.sbp)
    inside = x.placement.coord(context.current().rank) is not None
    local = func(*local_args) if inside else x._local
    return make(local, Layout(x.placement, sbp), shape, x._sizes, unit=x._unit)


def _sum(func: Any, args: tuple, kwargs: dict) -> GlobalTensor:
    """A sum keeps the ragged cut of the dims it keeps; over a cut dim each rank's part is a term (Partial)."""
    x = args[0]
    if any(isinstance(t, torch.Tensor) for t in tree_flatten((args[1:], kwargs))[0]):
        raise TypeError(f"{func}: only the summed tensor may be a tensor argument")
    if x._layout.has_partial:
        raise TypeError(f"{func}: a ragged input with a Partial axis ({x._layout.sbp}) cannot be summed here")
    ndim = x.dim()
    if func is aten.sum.default:
        dims, keep = list(range(ndim)), False
    else:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dims = list(range(ndim)) if not dims else [d % ndim for d in dims]
    sbp, sizes = [], []
    for a, s in enumerate(x._layout.sbp):
        if isinstance(s, (Split, Ragged)) and s.dim in dims:
            sbp.append(Partial())
            sizes.append(None)
        elif isinstance(s, (Split, Ragged)):
            d = s.dim if keep else s.dim - sum(k < s.dim for k in dims)
            sbp.append(type(s)(d))
            sizes.append(x._sizes[a])
        else:
            sbp.append(s)
            sizes.append(None)
    shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape) if keep or d not in dims)
    layout = Layout(x.placement, tuple(sbp))
    inside = x.placement.coord(context.current().rank) is not None
    largs = (x._local,) + tuple(args[1:])
    local = func(*largs, **kwargs) if inside else x._local.new_empty((0,))
    return make(local, layout, shape, tuple(sizes) if layout.ragged_axes else None, unit=x._unit)


__all__ = ["RaggedTensor", "convert", "from_local", "distribute", "make", "check_sizes", "local_shape",
           "boundary_cut", "runs_sizes"]


_view.RAGGED_VIEW["run"] = merged_view
