"""Routes to and from zigzag layouts (`Zigzag(d)`: rank i of n holds chunks i and 2n-1-i of 2n).

A zigzag layout of `x` holds exactly the shards that `Split(d)` gives of `x` with dim d in zigzag
order (`sbp.zigzag_order`), so most conversions are an ordinary route on that reading plus, at most,
one local permutation of a dim that a rank holds whole:

- zigzag -> zigzag on the same axis (other axes change): the ordinary route of the two readings;
- zigzag -> a layout that does not cut d (Broadcast, a split of another dim, Partial): the ordinary
  route from the zigzag reading, then each rank puts its whole dim d back in order ("unzigzag");
- the reverse: each rank puts its whole dim d into zigzag order ("zigzag"), then the ordinary route;
- zigzag <-> a contiguous cut of d: one uneven all-to-all on the zigzag axis ("recut": every rank
  receives exactly the rows its target holds and its source does not), then the ordinary route.

A permutation moves no bytes, so the first three receive what the ordinary route receives, and that
route meets the ordinary lower bound, which is the zigzag one (the same elements are missing). The
recut is at the bound when the two layouts differ only on the zigzag axis.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional

import torch

from ..layout import Layout
from ..sbp import Ragged, Split, Zigzag
from .boxes import Box, intersect, numel
from .route import RankExchange, Route, Step

Planner = Callable[[Layout, Layout, tuple, torch.dtype], Route]


def route(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype, plain: Planner) -> Route:
    """The route for a conversion with a zigzag end; `plain` plans zigzag-free conversions (cached)."""
    world = max(src.placement.flat_ranks + dst.placement.flat_ranks) + 1
    steps, bound = _steps(src, dst, shape, dtype, plain, world)
    return Route(src, dst, shape, dtype, tuple(steps), bound, world)


def _zig(layout: Layout) -> Optional[tuple]:
    """(mesh axis, dim, axis size, the earlier axes cutting the dim with their sizes) of the layout's
    zigzag, or None: two layouts with the same key read their zigzag dim in the same order."""
    for a, s in enumerate(layout.sbp):
        if isinstance(s, Zigzag):
            shape = layout.placement.shape
            earlier = tuple((b, shape[b]) for b, t in enumerate(layout.sbp[:a]) if t == Split(s.dim))
            return a, s.dim, shape[a], earlier
    return None


def _cuts(layout: Layout, dim: int) -> bool:
    return any(isinstance(s, (Split, Zigzag, Ragged)) and s.dim == dim for s in layout.sbp)


def _steps(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, plain: Planner,
           world: int) -> tuple[list[Step], Optional[tuple[int, ...]]]:
    zs, zd = _zig(src), _zig(dst)
    if zs is None and zd is None:
        sub = plain(src, dst, shape, dtype)
        return list(sub.steps), sub.lower_bound
    if zs is not None and zs == zd:
        sub = plain(src.zigzag_as_split(), dst.zigzag_as_split(), shape, dtype)
        return list(sub.steps), sub.lower_bound
    if zs is not None and not _cuts(dst, zs[1]):
        sub = plain(src.zigzag_as_split(), dst, shape, dtype)
        return list(sub.steps) + [_local_step("unzigzag", src, dst, world)], sub.lower_bound
    if zd is not None and not _cuts(src, zd[1]):
        sub = plain(src, dst.zigzag_as_split(), shape, dtype)
        if [st.primitive for st in sub.steps] == ["slice"] and src.placement == dst.placement and all(
                a == zd[0] or s == t for a, (s, t) in enumerate(zip(src.sbp, dst.sbp))):
            # Broadcast -> zigzag on one axis: each rank takes its two chunks (no permuted copy of the whole)
            return [_local_step("zigzag_slice", src, dst, world)], sub.lower_bound
        return [_local_step("zigzag", src, dst, world)] + list(sub.steps), sub.lower_bound
    if zs is not None:  # d is cut contiguously on the other side: recut to Split(d), then onwards
        mid = src.zigzag_as_split()
        rest, _ = _steps(mid, dst, shape, dtype, plain, world)
        steps = [_recut_step(src, mid, shape, dtype, world)] + rest
    else:
        mid = dst.zigzag_as_split()
        rest, _ = _steps(src, mid, shape, dtype, plain, world)
        steps = rest + [_recut_step(mid, dst, shape, dtype, world)]
    bound = _lower_bound(src, dst, shape, dtype, world)
    if bound is not None and sum(sum(st.recv_bytes) for st in steps) > sum(bound):
        # the recut moved rows that the ordinary route then moves again: one exchange of what each lacks
        steps = [_direct(src, dst, shape, dtype, world)]
    return steps, bound


def _local_step(kind: str, src: Layout, dst: Layout, world: int) -> Step:
    """Each rank permutes its whole dim d: into zigzag order ("zigzag") or back ("unzigzag"), or takes
    its two chunks of it ("zigzag_slice")."""
    return Step(kind, src, dst, None, (0,) * world, 0)


def _recut_step(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, world: int) -> Step:
    """Zigzag(d) <-> Split(d) on one axis, the other axes alike: what each rank receives."""
    axis, d = (_zig(src) or _zig(dst))[:2]
    recv = [0] * world
    for r in src.placement.flat_ranks:
        local = dst.local_shape(shape, r)
        row = 1
        for i, n in enumerate(local):
            row *= 1 if i == d else n
        for peer, rows in _recut_exchange(src, dst, shape, r)[1].items():
            if peer != r:
                recv[r] += sum(n for _, n in rows) * row * dtype.itemsize
    return Step("recut", src, dst, axis, tuple(recv), 1)


@lru_cache(maxsize=1024)
def _recut_exchange(src: Layout, dst: Layout, shape: tuple, rank: int) -> tuple[dict, dict]:
    """(sends, receives) of `rank` in a recut: per peer of its axis group, the (local row, rows) pieces,
    in the one order both sides walk (the sender's source ranges, then the receiver's target ranges)."""
    axis, d = (_zig(src) or _zig(dst))[:2]
    group = src.placement.group(rank, axis)
    ranges = {r: (src.ranges(shape, r)[d], dst.ranges(shape, r)[d]) for r in group}

    def pieces(source: tuple, target: tuple, local_of_target: bool) -> list[tuple[int, int]]:
        out = []
        s_off = 0
        for s_start, s_n in source:
            t_off = 0
            for t_start, t_n in target:
                lo, hi = max(s_start, t_start), min(s_start + s_n, t_start + t_n)
                if hi > lo:
                    out.append((t_off + lo - t_start if local_of_target else s_off + lo - s_start, hi - lo))
                t_off += t_n
            s_off += s_n
        return out
    sends = {peer: pieces(ranges[rank][0], ranges[peer][1], False) for peer in group}
    recvs = {peer: pieces(ranges[peer][0], ranges[rank][1], True) for peer in group}
    return sends, recvs


def _lower_bound(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, world: int
                 ) -> Optional[tuple[int, ...]]:
    """Per rank, the bytes of its target rows it does not hold (rows per dim are unions of ranges, so
    held-and-needed is a product over dims). None where an end is Partial."""
    if src.has_partial or dst.has_partial:
        return None
    out = [0] * world
    for r in dst.placement.flat_ranks:
        need = dst.ranges(shape, r)
        total, common = 1, 1
        have = src.ranges(shape, r) if r in src.placement else None
        for d, rs in enumerate(need):
            total *= sum(n for _, n in rs)
            common *= 0 if have is None else sum(
                max(0, min(a + n, b + m) - max(a, b)) for a, n in rs for b, m in have[d])
        out[r] = (total - common) * dtype.itemsize
    return tuple(out)


def _pieces(layout: Layout, shape: tuple, rank: int) -> list[tuple[Box, tuple[int, ...]]]:
    """The boxes of the global tensor `rank` holds, each with where it starts in the local shard (a
    zigzag dim gives two; every other layout one, at the origin)."""
    per_dim = []
    for rs in layout.ranges(shape, rank):
        at, out = 0, []
        for start, n in rs:
            out.append((start, n, at))
            at += n
        per_dim.append(out)
    boxes = [((), ())]
    for options in per_dim:
        boxes = [(b + ((start, n),), o + (at,)) for b, o in boxes for start, n, at in options]
    return boxes


def _local_box(part: Box, piece: Box, origin: tuple[int, ...]) -> Box:
    return tuple((s - p + o, n) for (s, n), (p, _), o in zip(part, piece, origin))


def _direct(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, world: int) -> Step:
    """Point-to-point: every rank receives exactly the rows of its target it does not hold, each from one
    holder (the least loaded), and copies the rest (both ends Partial-free; pieces as `_pieces`)."""
    held = {r: _pieces(src, shape, r) for r in src.placement.flat_ranks}
    load: dict[int, int] = {}
    sends: dict[int, dict[int, list[Box]]] = {}
    recvs: dict[int, dict[int, list[Box]]] = {}
    regions: dict[int, list] = {}
    for r in dst.placement.flat_ranks:
        regions[r] = []
        for box, origin in _pieces(dst, shape, r):
            for s_box, s_origin in {b for q in held.values() for b in q}:
                part = intersect(box, s_box)
                if numel(part) == 0:
                    continue
                out = _local_box(part, box, origin)
                if (s_box, s_origin) in held.get(r, ()):
                    regions[r].append(("copy", out, _local_box(part, s_box, s_origin)))
                    continue
                holders = sorted(q for q, pieces in held.items() if (s_box, s_origin) in pieces)
                sender = min(holders, key=lambda q: (load.get(q, 0), q))
                load[sender] = load.get(sender, 0) + numel(part)
                got = recvs.setdefault(r, {}).setdefault(sender, [])
                regions[r].append(("recv", out, (sender, len(got))))
                got.append(out)
                sends.setdefault(sender, {}).setdefault(r, []).append(_local_box(part, s_box, s_origin))
    recv_bytes = [0] * world
    exchanges, latency = [], 0
    for r in sorted(set(src.placement.flat_ranks) | set(dst.placement.flat_ranks)):
        rs = tuple((q, tuple(b)) for q, b in sorted(sends.get(r, {}).items()))
        rr = tuple((q, tuple(b)) for q, b in sorted(recvs.get(r, {}).items()))
        recv_bytes[r] = sum(numel(b) for _, bs in rr for b in bs) * dtype.itemsize
        latency = max(latency, len(rs), len(rr))
        out_shape = dst.local_shape(shape, r) if r in dst.placement else (0,)
        exchanges.append((r, RankExchange(tuple(out_shape), tuple(regions.get(r, ())), rs, rr)))
    return Step("send_recv" if latency else "local", src, dst, None, tuple(recv_bytes), latency,
                exchanges=tuple(exchanges))


# -- execution ------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _order(layout: Layout, shape: tuple, inverse: bool) -> torch.Tensor:
    order = torch.tensor(layout.zigzag_order(shape), dtype=torch.long)
    return torch.argsort(order) if inverse else order


def _compile_permute(step: Step, shape: tuple, rank: int) -> Optional[Callable]:
    inverse = step.primitive == "unzigzag"
    holder = step.dst if inverse else step.src  # the ranks whose shard holds dim d whole
    if rank not in holder.placement:
        return None
    zigzag = step.src if inverse else step.dst
    d = _zig(zigzag)[1]
    order = _order(zigzag, shape, inverse)

    def permute(local: torch.Tensor, comm) -> torch.Tensor:
        return local.index_select(d, order.to(local.device))
    return permute


def _compile_take(step: Step, shape: tuple, rank: int) -> Optional[Callable]:
    if rank not in step.src.placement:
        return None
    d = _zig(step.dst)[1]
    chunks = step.dst.ranges(shape, rank)[d]  # the source holds d whole: global rows are local rows

    def take(local: torch.Tensor, comm) -> torch.Tensor:
        return torch.cat([local.narrow(d, start, n) for start, n in chunks], d)
    return take


def _compile_recut(step: Step, shape: tuple, rank: int) -> Optional[Callable]:
    if rank not in step.src.placement:
        return None
    axis, d = (_zig(step.src) or _zig(step.dst))[:2]
    group = step.src.placement.group(rank, axis)
    sends, recvs = _recut_exchange(step.src, step.dst, shape, rank)
    send_pieces = [p for peer in group for p in sends[peer]]
    send_rows = [sum(n for _, n in sends[peer]) for peer in group]
    recv_rows = [sum(n for _, n in recvs[peer]) for peer in group]
    placed = []  # (row in the received buffer, row in the new shard, rows)
    at = 0
    for peer in group:
        for row, n in recvs[peer]:
            placed.append((at, row, n))
            at += n
    out_rows = step.dst.local_shape(shape, rank)[d]

    def recut(local: torch.Tensor, comm) -> torch.Tensor:
        moved = local.movedim(d, 0) if d else local
        rest = tuple(moved.shape[1:])
        per_row = 1
        for n in rest:
            per_row *= n
        send = torch.cat([moved[row:row + n] for row, n in send_pieces]).reshape(-1) if send_pieces else \
            moved.new_empty(0)
        recv = moved.new_empty(at * per_row)
        comm.all_to_all_into(send, [n * per_row for n in send_rows], recv, [n * per_row for n in recv_rows],
                             tuple(group))
        got = recv.view((at,) + rest)
        out = moved.new_empty((out_rows,) + rest)
        for src_row, row, n in placed:
            out[row:row + n] = got[src_row:src_row + n]
        return out.movedim(0, d).contiguous() if d else out
    return recut


COMPILE = {"zigzag": _compile_permute, "unzigzag": _compile_permute, "zigzag_slice": _compile_take,
           "recut": _compile_recut}

__all__ = ["route", "COMPILE"]
