"""1-D transitions: change the SBP of one mesh axis, as a collective on that axis' groups.

The table maps (source kind, target kind) to the primitive; `transition`
checks when the 1-D view is exact (no later mesh axis splits the same tensor
dim, partial axes reduced innermost-first) and prices the step per rank.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..layout import Layout
from ..runtime.comm import all_reduce_recv_bytes
from ..sbp import SBP, Broadcast, Partial, Split
from .boxes import intersect, numel
from .route import Step

TRANSITIONS = {
    ("S", "B"): "all_gather",
    ("S", "S"): "all_to_all",
    ("B", "S"): "slice",
    ("P", "B"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("B", "P"): "fill",   # keep the value on index 0 of the axis, the op's identity elsewhere (sum)
    ("S", "P"): "pad",    # own shard inside the op's identity
}


def kind(s: SBP) -> str:
    return "S" if isinstance(s, Split) else "B" if isinstance(s, Broadcast) else "P"


def _later_splits(sbp: Sequence[SBP], axis: int, dim: int) -> bool:
    return any(isinstance(s, Split) and s.dim == dim for s in sbp[axis + 1:])


def _later_partial_ops(sbp: Sequence[SBP], axis: int) -> list[str]:
    return [s.op for s in sbp[axis + 1:] if isinstance(s, Partial)]


def transition(src: Layout, axis: int, target: SBP, shape: tuple[int, ...],
               dtype: torch.dtype) -> Optional[Step]:
    """The step that sets `src.sbp[axis]` to `target`, or None when no 1-D primitive does it exactly."""
    s = src.sbp[axis]
    prim = TRANSITIONS.get((kind(s), kind(target)))
    if prim is None or s == target:
        return None
    for x in (s, target):
        if isinstance(x, Split) and _later_splits(src.sbp, axis, x.dim):
            return None  # a later axis cuts this dim further: the group's pieces are not one 1-D split
    if isinstance(s, Partial) and any(op != s.op for op in _later_partial_ops(src.sbp, axis)):
        return None  # later axes reduce first; a different op there does not commute
    if prim == "pad" and target.op != "sum" and "sum" in _later_partial_ops(src.sbp, axis):
        return None  # a later sum would add up the identity (inf / iinfo) fill
    dst = Layout(src.placement, src.sbp[:axis] + (target,) + src.sbp[axis + 1:])
    op = s.op if isinstance(s, Partial) else target.op if isinstance(target, Partial) else None
    recv, latency = _price(prim, src, dst, axis, shape, dtype.itemsize)
    return Step(prim, src, dst, axis, recv, latency, op)


def _price(prim: str, src: Layout, dst: Layout, axis: int, shape: tuple[int, ...],
           itemsize: int) -> tuple[tuple[int, ...], int]:
    p = src.placement
    n = p.shape[axis]
    recv = [0] * (max(p.flat_ranks) + 1)
    if prim in ("slice", "fill", "pad") or n == 1:
        return tuple(recv), 0
    for r in p.flat_ranks:
        group = p.group(r, axis)
        if prim == "all_gather":
            got = sum(numel(src.shard(shape, q)) for q in group if q != r)
        elif prim == "all_to_all":
            mine = dst.shard(shape, r)
            got = sum(numel(intersect(src.shard(shape, q), mine)) for q in group if q != r)
        elif prim == "reduce_scatter":
            got = (n - 1) * numel(dst.shard(shape, r))
        else:  # all_reduce
            recv[r] = all_reduce_recv_bytes(numel(src.shard(shape, r)), itemsize, n, group.index(r))
            continue
        recv[r] = got * itemsize
    return tuple(recv), 1
