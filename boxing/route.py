"""Routes as data: the steps that turn one layout into another, with what each rank receives.

A `Route` holds everything every rank needs to run it (groups follow from the
layouts; point-to-point exchanges are spelled out per rank), so all ranks build
the same route and issue the same collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..layout import Layout
from .boxes import Box

# (kind, box in the output local, arg): kind "copy" (arg = box in the input local),
# "recv" (arg = (peer, index of the piece in that peer's message)), "fill" (arg = reduce op)
Region = tuple[str, Box, object]


@dataclass(frozen=True)
class RankExchange:
    """One rank's part of a point-to-point exchange."""
    out_shape: tuple[int, ...]
    regions: tuple[Region, ...]                          # partition the output local
    sends: tuple[tuple[int, tuple[Box, ...]], ...]       # (peer, boxes of the input local, packed in order)
    recvs: tuple[tuple[int, tuple[Box, ...]], ...]       # (peer, boxes of the output local, in message order)
    # (group, src rank, box of the input local on src / None elsewhere, numel), run before the sends
    bcasts: tuple[tuple[tuple[int, ...], int, Optional[Box], int], ...] = ()


@dataclass(frozen=True)
class Step:
    """One primitive. `axis` is the mesh axis of a 1-D step (its groups are the axis groups)."""
    primitive: str
    src: Layout
    dst: Layout
    axis: Optional[int]
    recv_bytes: tuple[int, ...]  # indexed by global rank
    latency: int                 # collective launches (point-to-point: most peers of one rank)
    op: Optional[str] = None
    exchanges: tuple[tuple[int, RankExchange], ...] = field(default=(), repr=False)  # point-to-point only

    @property
    def bytes(self) -> int:
        return sum(self.recv_bytes)

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """The rank groups the step communicates on."""
        if self.axis is not None:
            return self.src.placement.axis_groups(self.axis)
        out = [tuple(sorted({r} | {p for p, _ in ex.sends} | {p for p, _ in ex.recvs}))
               for r, ex in self.exchanges if ex.recvs]
        return out + list(dict.fromkeys(g for _, ex in self.exchanges for g, *_ in ex.bcasts))

    def exchange(self, rank: int) -> RankExchange | None:
        return dict(self.exchanges).get(rank)

    def describe(self) -> str:
        where = f"mesh axis {self.axis}" if self.axis is not None else "rank groups " + ", ".join(
            map(str, self.groups)) if self.exchanges and self.latency else "each rank"
        op = f" {self.op}" if self.op and self.op != "sum" else ""
        return f"{self.primitive}{op} on {where}: {_sbp(self.src)} -> {_sbp(self.dst)}"


@dataclass(frozen=True)
class Route:
    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    dtype: torch.dtype
    steps: tuple[Step, ...]
    lower_bound: Optional[tuple[int, ...]]  # per global rank; None when the source has Partial axes
    world: int                              # len of recv_bytes: highest rank of either placement + 1
    # (rank, world size) -> that rank's steps with their boxes and groups worked out (boxing.execute fills it)
    programs: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def recv_bytes(self) -> list[int]:
        """Bytes each global rank receives over the whole route (0 beyond `world`)."""
        out = [0] * self.world
        for s in self.steps:
            for r, b in enumerate(s.recv_bytes):
                out[r] += b
        return out

    def recv_bytes_of(self, rank: int) -> int:
        return self.recv_bytes[rank] if rank < self.world else 0

    @property
    def cost(self) -> tuple[int, int]:
        """(total bytes received over all ranks, collective launches): what the planner minimises."""
        return sum(s.bytes for s in self.steps), sum(s.latency for s in self.steps)

    def explain(self) -> str:
        head = f"{self.src} -> {self.dst}, shape {self.shape}, {self.dtype}"
        if self.src.placement == self.dst.placement:
            head = (f"{_sbp(self.src)} -> {_sbp(self.dst)} on {self.src.placement}, "
                    f"shape {self.shape}, {self.dtype}")
        lines = [head]
        for i, s in enumerate(self.steps, 1):
            lines.append(f"  {i}. {s.describe()}; recv bytes per rank {list(s.recv_bytes)} (total {s.bytes})")
        if not self.steps:
            lines.append("  (nothing to do)")
        total, latency = self.cost
        lines.append(f"  recv bytes per rank {self.recv_bytes} (total {total}), {latency} latency terms (collectives; peers for point-to-point)")
        if self.lower_bound is None:
            lines.append("  lower bound: none (the source has Partial axes; reductions are at most "
                         "reduce-scatter/all-reduce over them)")
        else:
            lb = list(self.lower_bound)
            met = "met" if sum(lb) == total else "NOT met"
            lines.append(f"  lower bound per rank {lb} (total {sum(lb)}): {met}")
        return "\n".join(lines)


def _sbp(layout: Layout) -> str:
    return "(" + ", ".join(map(repr, layout.sbp)) + ")"
