"""The arithmetic of ragged cuts: which rows each rank holds, from a layout, its sizes and a reshape's unit.

Conversions, the op handlers and the grouped ops all ask the same questions of a cut (the sizes an
axis cuts its dim in for some rank's group, the runs a reshape's unit gives on nested axes, whether
those are the balanced ones, the block a rank holds); they are answered here from layouts and sizes
alone, with no `RaggedTensor` in sight, so every module above can ask them without importing the
tensor class. The two local re-cuts that follow directly from them (`_take_ragged`, `_recut_units`)
sit here too.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..boxing import ragged as _recut
from ..layout import Layout
from ..placement import Placement
from ..runtime import context
from ..sbp import Broadcast, Ragged, Split, split_sizes

Sizes = tuple  # per mesh axis: None, or one size per rank of the axis


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


def _balanced_sbp(layout: Layout) -> tuple:
    return tuple(Split(s.dim) if isinstance(s, Ragged) else s for s in layout.sbp)


def _take_ragged(t: torch.Tensor, layout: Layout, sizes: Sizes) -> torch.Tensor:
    coord = layout.placement.coord(context.current().rank)
    for a in layout.ragged_axes:
        t = _recut.take(t, layout.sbp[a].dim, sizes[a], coord[a])
    return t


def _shown(sizes: Sizes) -> Any:
    kept = [list(s) for s in sizes if s is not None]
    return kept[0] if len(kept) == 1 else sizes


def _inside(layout: Layout) -> bool:
    return layout.placement.coord(context.current().rank) is not None


# -- a reshape's runs: sizes in units, nested over several mesh axes --------------------------------
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


# what an op handler (`views.py`'s, `rules.py`'s) gives where it does not take the call: the op path
# (`run.py`) asks the next, or balances a reshape's rows, or refuses
_NOT_TAKEN = object()
