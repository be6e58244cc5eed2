"""Routes to and from strided layouts (`Strided(d, g)`: d viewed as g blocks, each split over one mesh axis).

A strided layout of `x` holds exactly the shards that `Split(d + 1)` gives of `x.unflatten(d, (g, -1))`
(the *unflattened reading*: rank i holds piece i of each of the g blocks, which is piece i of the new
dim d + 1 for every block), and a rank's local shard unflattens the same way for free. So:

- strided -> strided (the same axis, dim and groups), or between a strided layout and one that does
  not cut d (Broadcast, Partial, a split of another dim): the ordinary route of the two unflattened
  readings, its local result flattened back. The bytes are that route's, which meets the ordinary
  lower bound (the same elements are missing); gathering a strided split is an all-gather, and
  flattening it back the one local permutation (the blocks' pieces interleaved back in order).
  A route that is one all-reduce (a data axis's gradient bucket) stays one bucketable all-reduce.
- strided <-> a layout that cuts d otherwise (`Split(d)`, other groups): one point-to-point exchange
  in which every rank receives exactly the rows of its target it does not hold (`zigzag._direct`,
  on `Layout.ranges`: the lower bound), where neither end is Partial; else through the layout with
  the strided axis Broadcast (correct, not the bound).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..layout import Layout
from ..sbp import Broadcast, Ragged, Split, Strided, Zigzag
from .route import Route, Step
from .zigzag import _direct, _lower_bound

Planner = Callable[[Layout, Layout, tuple, torch.dtype], Route]


@dataclass(frozen=True)
class ReadingStep(Step):
    """A route run on the unflattened reading (`sub`, planned for the unflattened shape)."""
    sub: Optional[Route] = None
    dim: int = 0
    groups: int = 1


def _key(layout: Layout) -> Optional[tuple[int, int, int]]:
    for a, s in enumerate(layout.sbp):
        if isinstance(s, Strided):
            return a, s.dim, s.groups
    return None


def _cuts(layout: Layout, dim: int) -> bool:
    return any(isinstance(s, (Split, Zigzag, Ragged, Strided)) and s.dim == dim for s in layout.sbp)


def unflattened(layout: Layout, dim: int) -> Layout:
    """`layout` of the tensor with `dim` unflattened into (groups, block): a strided split of `dim` is a split
    of the block dim, dims after `dim` move one right (`layout` cuts `dim` only strided, if at all)."""
    def move(s):
        if isinstance(s, Strided):
            return Split(s.dim + 1)
        if isinstance(s, (Split, Zigzag, Ragged)) and s.dim > dim:
            return type(s)(s.dim + 1)
        return s
    return Layout(layout.placement, tuple(move(s) for s in layout.sbp))


def route(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype, plain: Planner) -> Route:
    """The route for a conversion with a strided end; `plain` plans strided-free conversions (cached)."""
    world = max(src.placement.flat_ranks + dst.placement.flat_ranks) + 1
    steps, bound = _steps(src, dst, shape, dtype, plain, world)
    return Route(src, dst, shape, dtype, tuple(steps), bound, world)


def _steps(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, plain: Planner,
           world: int) -> tuple[list[Step], Optional[tuple[int, ...]]]:
    ks, kd = _key(src), _key(dst)
    if ks is None and kd is None:
        sub = plain(src, dst, shape, dtype)
        return list(sub.steps), sub.lower_bound
    if (ks is not None and ks == kd) or (kd is None and not _cuts(dst, ks[1])) or (
            ks is None and not _cuts(src, kd[1])):
        _, d, g = ks or kd
        return _reading(src, dst, shape, dtype, plain, world, d, g)
    if not src.has_partial and not dst.has_partial:
        return [_direct(src, dst, shape, dtype, world)], _lower_bound(src, dst, shape, dtype, world)
    if ks is not None:  # a Partial end and d cut otherwise: gather the strided axis first (not the bound)
        mid = Layout(src.placement, tuple(Broadcast() if a == ks[0] else s for a, s in enumerate(src.sbp)))
        first, _ = _steps(src, mid, shape, dtype, plain, world)
        rest, _ = _steps(mid, dst, shape, dtype, plain, world)
        return first + rest, None
    mid = Layout(dst.placement, tuple(Broadcast() if a == kd[0] else s for a, s in enumerate(dst.sbp)))
    first, _ = _steps(src, mid, shape, dtype, plain, world)
    rest, _ = _steps(mid, dst, shape, dtype, plain, world)
    return first + rest, None


def _reading(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, plain: Planner, world: int,
             d: int, g: int) -> tuple[list[Step], Optional[tuple[int, ...]]]:
    ushape = shape[:d] + (g, shape[d] // g) + shape[d + 1:]
    sub = plain(unflattened(src, d), unflattened(dst, d), ushape, dtype)
    if not sub.steps:
        return [], sub.lower_bound
    if len(sub.steps) == 1 and sub.steps[0].primitive == "all_reduce":  # shape-free: stays one (bucketable) collective
        s = sub.steps[0]
        return [Step("all_reduce", src, dst, s.axis, s.recv_bytes, s.latency, s.op)], sub.lower_bound
    recv = tuple(sub.recv_bytes)
    latency = sum(s.latency for s in sub.steps)
    prims = "+".join(s.primitive for s in sub.steps)
    axes = {s.axis for s in sub.steps}
    axis = axes.pop() if len(axes) == 1 else None  # where its collectives run, for explain()
    return [ReadingStep(f"strided({prims})", src, dst, axis, recv, latency, None, sub=sub, dim=d, groups=g)], \
        sub.lower_bound


__all__ = ["route", "unflattened", "ReadingStep"]
