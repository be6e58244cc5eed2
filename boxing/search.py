"""The planner: an exact shortest path over nd-SBP states, plus direct exchanges.

Nodes are layouts on the source placement (and the target itself when it
lives elsewhere). Edges are the 1-D transitions of `rules` on one mesh axis,
and, from every Partial-free node, one direct exchange straight to the
target (`exchange`); a Partial node whose SBP is the target's on another
placement of the same mesh shape also moves there as it is (`relocate`).
Dijkstra on the lexicographic cost of `cost` (time first: alphas and betas
of the link model in force) returns the cheapest route; ties go to fewer collective launches, so a named collective beats a
point-to-point exchange of the same bytes.
"""
from __future__ import annotations

import heapq
from functools import lru_cache
from typing import Sequence

import torch

from ..layout import Layout
from ..runtime.topology import on_change
from ..sbp import Broadcast, Partial, Split
from . import cost as C
from . import strided, zigzag
from .exchange import direct, relocate
from .route import Route, Step
from .transitions import transition


def check(src: Layout, dst: Layout, shape: tuple[int, ...]) -> None:
    """Reject conversions that have no meaning, naming the argument and the fix."""
    if src.placement.device_type != dst.placement.device_type:
        raise ValueError(
            f"to_global(placement): the tensor lives on device type {src.placement.device_type!r} but the "
            f"target placement has {dst.placement.device_type!r}; use gt.placement("
            f"{src.placement.device_type!r}, ...) (moving between device types is not boxing)")
    src.check_shape(shape, "to_global(x)")
    dst.check_shape(shape, "to_global(sbp)")
    for a, (s, t) in enumerate(zip(src.sbp, dst.sbp)):
        if isinstance(s, Partial) and isinstance(t, Partial) and s.op != t.op and src.placement == dst.placement:
            raise ValueError(
                f"to_global(sbp): mesh axis {a} goes from {s!r} to {t!r}, but {s.op}-partial values cannot "
                f"be re-read as {t.op}-partial ones; reduce first (to gt.broadcast or a split) and then "
                f"convert to {t!r} if that is what you mean")


def route(src: Layout, dst: Layout, shape: Sequence[int], dtype: torch.dtype) -> Route:
    """The quickest route converting `src` to `dst` for a global `shape` and `dtype` (cached while the link
    model stays in force, `runtime/topology.py`: a byte between nodes is priced by the across link's beta)."""
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise TypeError("boxing.route(src_layout, dst_layout, shape, dtype): layouts must be gt.Layout")
    return _route(src, dst, tuple(map(int, shape)), dtype)


@lru_cache(maxsize=4096)
def _route(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> Route:
    check(src, dst, shape)
    if src.strided_axes or dst.strided_axes:  # an ordinary route on the unflattened reading, or an exchange
        return strided.route(src, dst, shape, dtype, _route)
    if src.zigzag_axes or dst.zigzag_axes:  # an ordinary route on the zigzag reading, or a recut
        return zigzag.route(src, dst, shape, dtype, _route)
    world = max(src.placement.flat_ranks + dst.placement.flat_ranks) + 1
    # a step on a mesh axis of one rank only renames its SBP (that rank holds the whole value either way):
    # it moves nothing, and left in, it would cost a copy and keep a ZeRO bucket from being one collective
    steps = [s for s in search(src, dst, shape, dtype) if s.axis is None or s.src.placement.shape[s.axis] > 1]
    return Route(src, dst, shape, dtype, tuple(steps), C.lower_bound(src, dst, shape, dtype), world)


def alternatives(src: Layout, dst: Layout, ndim: int) -> list:
    """The SBPs a mesh axis may take on the way: splits, broadcast, and the target's partial ops."""
    ops = [s.op for s in dst.sbp if isinstance(s, Partial)]
    return [Split(d) for d in range(ndim)] + [Broadcast()] + [Partial(op) for op in dict.fromkeys(ops)]


def edges(node: Layout, src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> list[Step]:
    """Every step out of `node` (a layout on the source placement)."""
    out = []
    if node.placement == src.placement:
        for axis in range(node.placement.ndim):
            for t in alternatives(src, dst, len(shape)):
                step = transition(node, axis, t, shape, dtype)
                if step is not None:
                    out.append(step)
    if not node.has_partial and node != dst:
        out.append(direct(node, dst, shape, dtype))
    elif (node.has_partial and node.placement != dst.placement and node.sbp == dst.sbp
          and node.placement.shape == dst.placement.shape):
        out.append(relocate(node, dst, shape, dtype))
    return out


def search(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> list[Step]:
    if src == dst:
        return []
    best = {src: C.ZERO}
    back: dict[Layout, tuple[Layout, Step]] = {}
    heap = [(C.ZERO, 0, src)]
    seq = 1
    while heap:
        cost, _, node = heapq.heappop(heap)
        if cost != best.get(node):
            continue
        if node == dst:
            path = []
            while node != src:
                node, step = back[node]
                path.append(step)
            return path[::-1]
        if node.placement != src.placement:
            continue
        for step in edges(node, src, dst, shape, dtype):
            c = C.add(cost, C.step_cost(step))
            old = best.get(step.dst)
            if old is None or c < old:
                best[step.dst] = c
                back[step.dst] = (node, step)
                heapq.heappush(heap, (c, seq, step.dst))
                seq += 1
    raise AssertionError(f"boxing: no route from {src} to {dst}")  # the direct edge always exists


on_change(_route.cache_clear)
