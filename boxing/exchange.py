"""Direct exchange: every destination rank receives exactly the part of its shard it lacks.

Works between any two Partial-free-source layouts, on the same placement or
across placements (disjoint, overlapping, other mesh shapes). The source tiles
the tensor into distinct boxes, each held by one or more ranks (replicas); a
destination rank copies what it holds and receives each missing piece from
one holder, on its own node where one is (`runtime/topology.py`), chosen to
spread the sending load. For a Partial destination, the ranks of a partial group (same shard, different partial coordinates) split the
contributions: whoever holds a piece contributes it, the others hold the op's
identity there, and only pieces nobody in the group holds are received.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..layout import Layout
from ..sbp import Partial
from .boxes import Box, intersect, numel, relative, sizes
from .route import RankExchange, Step


def _fill_op(dst: Layout, m: tuple[int, ...], c: tuple[int, ...]) -> str:
    """Identity op for member m where member c contributes: the last partial axis where they differ.

    Reductions run innermost (last axis) first, so along that axis m's identity
    is absorbed by c's value, and along earlier axes m's group already reduced to
    an identity of the earlier op.
    """
    axes = [a for a, s in enumerate(dst.sbp) if isinstance(s, Partial) and m[a] != c[a]]
    return dst.sbp[axes[-1]].op


def _overlaps(tiles: dict) -> Callable[[Box], list]:
    """`meeting(box)`: the (tile, holders) of `tiles` whose tile shares elements with `box`, in their order. Per dim
    the tiles take a few distinct ranges (a mesh axis's cuts), so a box is matched per dim against those, not
    against every tile: a direct exchange on 64 ranks meets 64 x 64 (tile, shard) pairs, most of them disjoint."""
    items = list(tiles.items())
    ndim = len(items[0][0]) if items else 0
    per_dim = []  # per dim: (start, size) -> the indices of the tiles with that range there
    for d in range(ndim):
        ranges: dict = {}
        for i, (tile, _) in enumerate(items):
            ranges.setdefault(tile[d], set()).add(i)
        per_dim.append(ranges)

    def meeting(box: Box) -> list:
        if not ndim:  # 0-d: the one element is in every tile
            return items
        found: set = set()
        for d, ranges in enumerate(per_dim):
            s, n = box[d]
            here: set = set()
            for (s2, n2), ids in ranges.items():
                if min(s + n, s2 + n2) > max(s, s2):
                    here |= ids
            found = here if d == 0 else found & here
            if not found:
                return []
        return [items[i] for i in sorted(found)]
    return meeting


def direct(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> Step:
    A, B = src.placement, dst.placement
    tiles: dict[Box, list[int]] = {}
    for r in A.flat_ranks:
        tiles.setdefault(src.shard(shape, r), []).append(r)
    own = {r: src.shard(shape, r) for r in A.flat_ranks}
    partial_axes = dst.partial_axes
    groups: dict[tuple, list[int]] = {}
    for r in B.flat_ranks:
        c = B.coord(r)
        groups.setdefault(tuple(None if a in partial_axes else x for a, x in enumerate(c)), []).append(r)

    regions: dict[int, list] = {r: [] for r in B.flat_ranks}
    wants = []  # (receiver, piece in its output, piece in the tile, holders)
    meeting = _overlaps(tiles)
    for members in groups.values():
        box = dst.shard(shape, members[0])
        zero = next(m for m in members if all(B.coord(m)[a] == 0 for a in partial_axes))
        for tile, holders in meeting(box):
            inter = intersect(tile, box)
            local = [m for m in members if own.get(m) == tile]
            c = local[0] if local else zero
            if local:
                regions[c].append(("copy", relative(inter, box), relative(inter, tile)))
            else:
                regions[c].append(None)  # placeholder, filled in below once the sender is chosen
                wants.append((c, len(regions[c]) - 1, relative(inter, box), relative(inter, tile), holders))
            for m in members:
                if m != c:
                    regions[m].append(("fill", relative(inter, box), _fill_op(dst, B.coord(m), B.coord(c))))

    # Spread the sending over replicas: a holder on the receiver's node first (a byte between nodes is
    # dearer: runtime/topology.py), then least bytes sent so far, then a rank that receives in this step
    # anyway (pairs become swaps and fewer ranks take part), then round-robin.
    topology = A.topology
    receivers = {c for c, *_ in wants}
    sends: dict[int, dict[int, list[Box]]] = {}
    recvs: dict[int, dict[int, list[Box]]] = {}
    load: dict[int, int] = {}
    for c, slot, out_box, tile_box, holders in wants:
        k = len(holders)
        i = min(range(k), key=lambda i: (topology.node(holders[i]) != topology.node(c), load.get(holders[i], 0),
                                         holders[i] not in receivers, (i - c) % k))
        sender = holders[i]
        load[sender] = load.get(sender, 0) + numel(out_box)
        got = recvs.setdefault(c, {}).setdefault(sender, [])
        regions[c][slot] = ("recv", out_box, (sender, len(got)))
        got.append(out_box)
        sends.setdefault(sender, {}).setdefault(c, []).append(tile_box)

    # One sender giving the same piece to several ranks that hear from no one else: a broadcast.
    bcasts: dict[int, list] = {}
    for sender in sorted(sends):
        to = sends[sender]
        pieces = {tuple(b) for b in to.values()}
        if len(to) >= 2 and len(pieces) == 1 and len(next(iter(pieces))) == 1 and all(
                list(recvs[c]) == [sender] for c in to):
            group = tuple(sorted({sender, *to}))
            box = next(iter(pieces))[0]
            for r in group:
                bcasts.setdefault(r, []).append((group, sender, box if r == sender else None, numel(box)))
            for c in to:
                del recvs[c][sender]
            del sends[sender]

    world = max(A.flat_ranks + B.flat_ranks) + 1
    recv_bytes = [0] * world
    exchanges = []
    latency = 0
    for r in sorted(set(A.flat_ranks) | set(B.flat_ranks)):
        rs = tuple((p, tuple(b)) for p, b in sorted(sends.get(r, {}).items()))
        rr = tuple((p, tuple(b)) for p, b in sorted(recvs.get(r, {}).items()))
        rb = tuple(bcasts.get(r, ()))
        recv_bytes[r] = (sum(numel(b) for _, bs in rr for b in bs)
                         + sum(n for _, src_, box, n in rb if src_ != r)) * dtype.itemsize
        latency = max(latency, len(rb) + max(len(rs), len(rr)))
        out_shape = sizes(dst.shard(shape, r)) if r in B else (0,)
        exchanges.append((r, RankExchange(out_shape, tuple(regions.get(r, ())), rs, rr, rb)))
    prim = ("broadcast" if bcasts and not sends else "send_recv") if latency else "local"
    return Step(prim, src, dst, None, tuple(recv_bytes), latency, exchanges=tuple(exchanges))


def relocate(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> Step:
    """A Partial layout moved as it is to another placement of the same mesh shape: each rank sends its
    whole shard to the rank at its mesh coordinate there (one message each, no reduction). `direct`
    needs a Partial-free source, so without this a Partial crossing placements was reduced first, even
    where the destination keeps it Partial (a tied weight's gradient going back to the stage that
    stores it, whose data-parallel bucket reduces it anyway)."""
    A, B = src.placement, dst.placement
    sends: dict[int, tuple] = {}
    recvs: dict[int, tuple] = {}
    regions: dict[int, tuple] = {}
    world = max(A.flat_ranks + B.flat_ranks) + 1
    recv_bytes = [0] * world
    for a, b in zip(A.flat_ranks, B.flat_ranks):  # the same mesh coordinate (flat order)
        box = src.shard(shape, a)
        whole = tuple((0, n) for n in sizes(box))
        if a == b:
            regions[b] = (("copy", whole, whole),)
            continue
        sends[a] = ((b, (whole,)),)
        recvs[b] = ((a, (whole,)),)
        regions[b] = (("recv", whole, (a, 0)),)
        recv_bytes[b] = numel(box) * dtype.itemsize
    exchanges = []
    for r in sorted(set(A.flat_ranks) | set(B.flat_ranks)):
        out_shape = sizes(dst.shard(shape, r)) if r in B else (0,)
        exchanges.append((r, RankExchange(out_shape, regions.get(r, ()), sends.get(r, ()), recvs.get(r, ()))))
    return Step("send_recv" if sends else "local", src, dst, None, tuple(recv_bytes), 1 if sends else 0,
                exchanges=tuple(exchanges))
