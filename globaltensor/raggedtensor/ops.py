"""Ragged tensors: a Split whose per-rank sizes are data (`gt.ragged(dim)`), carried by the tensor.

The layout holds `Ragged(dim)` without sizes, so every cache keyed on layouts stays keyed on
structure; a `RaggedTensor` holds the sizes (per ragged mesh axis, the same on every rank of that
axis: they cut the one global dim). Only ops whose shards stay meaningful with any cut accept
one, and they run on the wing's op path (`run.py`), not in the dispatcher, whose decisions assume
balanced shards:

- pointwise ops (sizes pass through; a Broadcast operand is sliced to the rows each rank holds),
  `*_like` factories, unsqueeze/expand (a sum's backward), sums (over the ragged dim: Partial),
  conversions (`to_global`), and the grouped ops of `globaltensor/raggedtensor/grouped.py`;
- generally, every op whose rule lets a split of the ragged dim pass through (it works along other
  dims: softmax, topk, one_hot, cumsum and argsort along others, bmm over it as the batch):
  `_by_rule`, on the shards, no data moved;
- every other op refuses a ragged input naming the op and the input (or, a reshape's runs, gets
  them balanced): a rule written for balanced shards would compute wrong values silently.

A user's ragged tensor cuts its dim over exactly one mesh axis (no other axis splits that dim),
which keeps every conversion a re-cut of contiguous ranges over one axis group (`boxing/ragged.py`).
A reshape's runs (`_unit`) may nest over several axes; their sizes follow from the unit on every
rank, so conversions that change several axes at once exchange blocks point to point.

The code: `cuts.py` (the arithmetic of cuts) <- `views.py` (a reshape's rows through a Linear),
`rules.py` (the general rule path) <- `run.py` (the op path: which handler takes a call) <- `tensor.py`
(the class, `make`, conversions; the class hands its calls and itself down to `run.py`) <- this module
(the user's construction), which hands the names on that the rest of the package imports from here.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..boxing import convert_local
from ..layout import Layout
from ..runtime import context
from ..sbp import Broadcast, Split
from ..tensor import GlobalTensor, device_for
from .cuts import _balanced, _take_ragged, check_sizes, local_shape, runs_sizes
from .tensor import FromLocal, RaggedTensor, boundary_cut, convert, make


# -- building from the user's shards or a whole tensor ----------------------------------------------
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
    return FromLocal.apply(local.to(device_for(p)), layout, shape, norm)


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


__all__ = ["RaggedTensor", "convert", "from_local", "distribute", "make", "check_sizes", "local_shape",
           "boundary_cut", "runs_sizes"]

