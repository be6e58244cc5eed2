"""Cost: bytes received per rank (DESIGN.md's convention), priced in time, and the lower bound they cannot beat.

A step's bytes take each rank its bytes times the beta of the link they cross, and each launch an alpha
of its link class (point to point: per message of the rank with most peers), by the link model in force
(`runtime/topology.py`). The planner minimises, lexicographically, (all ranks' time summed over the
route: every rank's bytes priced by the betas, plus each launch's alpha paid by every rank of the world;
collective launches; point-to-point steps; steps). That is the average rank's time (times the world):
additive along a path, so a shortest-path search is exact, and with no alpha it is the total of bytes
received (a byte between nodes counted as the beta ratio), so a route whose total equals the summed lower
bound meets the bound on every rank (every rank receives at least its own). Not the busiest rank's: an
uneven conversion would then trade one collective for two (P -> S(0) of one row over 3 ranks: reduce onto
rank 0, 16 B there, or reduce-scatter then all-to-all, 12 B on the busiest and 20 in all). The op
decisions weigh the busiest rank of a whole choice (`ops/decide.py`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..layout import Layout
from ..runtime.topology import LinkModel, Topology, in_force
from .boxes import intersect, numel

Cost = tuple[int, int, int, int]
ZERO: Cost = (0, 0, 0, 0)


def step_cost(step) -> Cost:
    """(all ranks' time: their bytes by the betas plus the alphas of its launches for every rank of the
    world; launches; point-to-point; 1), in ticks (`runtime/topology.py`)."""
    if step.axis is not None and step.src.placement.shape[step.axis] == 1:
        return ZERO  # a mesh axis of one rank: the step renames its SBP, moves nothing (the route drops it)
    model = in_force()
    return (len(step.recv_bytes) * launch_ticks(step, model) + sum(step_ticks(step, model)), step.latency,
            int(step.axis is None and step.latency > 0), 1)


def link_of(step) -> str:
    """The link class a step's launches run on: "across" where its group (a point-to-point message's two
    ends) spans nodes, else "inside"."""
    topology = step.src.placement.topology
    if topology.ranks_per_node is None:
        return "inside"
    if step.axis is not None:
        return step.src.placement.axis_kind[step.axis]
    return "across" if any(across_bytes(step, topology)) else "inside"


def launch_ticks(step, model: Optional[LinkModel] = None) -> int:
    """The alphas of a step: one per collective launch (point to point: per message of the busiest rank)."""
    model = in_force() if model is None else model
    return step.latency * model.link(link_of(step)).alpha_ticks if step.latency else 0


def step_ticks(step, model: Optional[LinkModel] = None) -> tuple[int, ...]:
    """Per global rank, the time its bytes of `step` take: each byte times the beta of the link it crosses."""
    model = in_force() if model is None else model
    inside = model.inside.beta_ticks
    topology = step.src.placement.topology
    if topology.ranks_per_node is None:
        return tuple(inside * b for b in step.recv_bytes)
    across = model.across.beta_ticks
    return tuple(inside * (b - a) + across * a for b, a in zip(step.recv_bytes, across_bytes(step, topology)))


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
