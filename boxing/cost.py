"""Cost: bytes received per rank (DESIGN.md's convention), and the lower bound they cannot beat.

The planner minimises, lexicographically, (total bytes received over all
ranks, a byte between nodes counted as the topology's `across_cost` bytes,
collective launches, point-to-point steps, steps). The total is
additive along a path, so a shortest-path search is exact; and because every
rank receives at least its own lower bound in any route, a route whose total
equals the summed bound meets the bound on every rank.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..layout import Layout
from ..runtime.topology import Topology
from .boxes import intersect, numel

Cost = tuple[int, int, int, int]
ZERO: Cost = (0, 0, 0, 0)


def step_cost(step) -> Cost:
    """A byte that crosses nodes counts `across_cost` bytes of the placement's topology (`runtime/topology.py`)."""
    if step.axis is not None and step.src.placement.shape[step.axis] == 1:
        return ZERO  # a mesh axis of one rank: the step renames its SBP, moves nothing (the route drops it)
    topology = step.src.placement.topology
    inside, across = link_bytes(step, topology)
    return (inside + topology.across_cost * across, step.latency, int(step.axis is None and step.latency > 0), 1)


def link_bytes(step, topology: Topology) -> tuple[int, int]:
    """(bytes received inside nodes, bytes received across them) by all ranks in `step`."""
    across = sum(across_bytes(step, topology))
    return step.bytes - across, across


def across_bytes(step, topology: Topology) -> tuple[int, ...]:
    """Per global rank, the bytes of `step` it receives over links between nodes. A collective whose group
    spans nodes is bound by its links between them: all its bytes count across. A point-to-point exchange
    counts each message by its two ends (a rank's bytes shared out by the elements of its messages)."""
    out = [0] * len(step.recv_bytes)
    if topology.ranks_per_node is None:
        return tuple(out)
    if step.axis is not None:
        for group in step.src.placement.axis_groups(step.axis):
            if topology.crosses(group):
                for r in group:
                    out[r] = step.recv_bytes[r]
        return tuple(out)
    for r, ex in step.exchanges:
        far = sum(numel(b) for q, boxes in ex.recvs for b in boxes if topology.node(q) != topology.node(r))
        far += sum(n for group, src, _, n in ex.bcasts if src != r and topology.crosses(group))
        total = sum(numel(b) for _, boxes in ex.recvs for b in boxes) + sum(n for _, src, _, n in ex.bcasts
                                                                             if src != r)
        if far and total:
            out[r] = step.recv_bytes[r] * far // total
    return tuple(out)


def priced_bytes(step) -> tuple[int, ...]:
    """Per global rank, the bytes of `step` it receives with a byte between nodes counted as the topology's
    `across_cost` bytes inside one: what a per-op choice weighs (on one node, the bytes themselves)."""
    topology = step.src.placement.topology
    if topology.ranks_per_node is None:
        return step.recv_bytes
    return tuple(b + (topology.across_cost - 1) * a for b, a in zip(step.recv_bytes, across_bytes(step, topology)))


def add(a: Cost, b: Cost) -> Cost:
    return tuple(x + y for x, y in zip(a, b))  # type: ignore[return-value]


def lower_bound(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype
                ) -> Optional[tuple[int, ...]]:
    """Per global rank: the bytes of its target shard that it does not already hold.

    None for a Partial source (no data-independent bound). For a Partial
    target, a partial group (ranks sharing a shard, differing only in partial
    coordinates) needs only the pieces none of its members holds; they are
    charged to the group's rank at partial coordinate 0.
    """
    if src.has_partial:
        return None
    A, B = src.placement, dst.placement
    world = max(A.flat_ranks + B.flat_ranks) + 1
    out = [0] * world
    pa = dst.partial_axes
    for r in B.flat_ranks:
        c = B.coord(r)
        if any(c[a] != 0 for a in pa):
            continue
        box = dst.shard(shape, r)
        members = [r]
        if pa:
            members = [q for q in B.flat_ranks
                       if all(B.coord(q)[a] == x for a, x in enumerate(c) if a not in pa)]
        held = {src.shard(shape, q) for q in members if q in A}
        have = sum(numel(intersect(t, box)) for t in held)
        out[r] = (numel(box) - have) * dtype.itemsize
    return tuple(out)
