"""Rows that move between ranks along split dims, each landing in the block of the rank that holds its place.

An op that only moves rows along a dim (roll, repeat, a pad or crop) keeps that dim's split if each rank receives
the rows that land in its block from the ranks holding them: point to point, each rank receiving exactly what it
lacks, where converting to another dim's split first would move the whole tensor. A move kind says where rows
[start, start + size) of a dim of n land (`_runs`); `moved_pieces` turns that into the pieces two ranks swap,
`exchange_moved` swaps them and `moved_cost` bills them as `Rule.kernel_cost` does.
"""
from __future__ import annotations

import itertools
import zlib
from functools import lru_cache

import torch

from ..boxing.boxes import numel, sizes
from ..layout import Layout, slice_box
from ..runtime import context
from ..runtime.symmetry import rank_specific
from ..sbp import Split


def _runs(kind: str, param: int, start: int, size: int, n: int) -> list:
    """Where rows [start, start + size) of a dim of n land: (source start, destination start, length) runs.
    `roll` by `param`: shifted, wrapping at n; `repeat` `param` times: once in each copy; `shift` by
    `param`: shifted, rows that land outside the result dropped (a pad's, by the pad before them; a crop's is
    negative)."""
    if kind == "repeat":
        return [(start, c * n + start, size) for c in range(param)] if size else []
    if kind == "shift":
        return [(start, start + param, size)] if size else []
    runs, dst = [], (start + param) % n if n else 0
    while size > 0:
        length = min(size, n - dst)
        runs.append((start, dst, length))
        start, dst, size = start + length, 0, size - length
    return runs


@lru_cache(maxsize=4096)
def moved_pieces(src_layout: Layout, in_shape: tuple, dst_layout: Layout, out_shape: tuple, moves: tuple,
                 src: int, dst: int) -> tuple:
    """The pieces of `src`'s input shard that land in `dst`'s output shard, as (box in src's shard, box in
    dst's shard). `moves`: (dim, kind, param) per dim the op moves rows along (`_runs`); every other dim is
    the same in both (the two ranks hold the same rows there)."""
    a, b = src_layout.shard(in_shape, src), dst_layout.shard(out_shape, dst)
    how = {d: (kind, param) for d, kind, param in moves}
    per_dim = []
    for d, ((s0, sn), (d0, dn)) in enumerate(zip(a, b)):
        if d not in how:
            per_dim.append([((0, sn), (0, dn))] if (s0, sn) == (d0, dn) else [])
            continue
        runs = []
        for start, to, length in _runs(*how[d], s0, sn, in_shape[d]):
            lo, hi = max(to, d0), min(to + length, d0 + dn)
            if hi > lo:
                runs.append(((start + lo - to - s0, hi - lo), (lo - d0, hi - lo)))
        per_dim.append(runs)
    pieces = [(tuple(p[0] for p in combo), tuple(p[1] for p in combo)) for combo in itertools.product(*per_dim)]
    return tuple(p for p in pieces if numel(p[1]))


def peers(layout: Layout, dims: set, rank: int) -> list[int]:
    """The ranks holding the same rows as `rank` but on the mesh axes that split one of `dims` (itself too)."""
    pl = layout.placement
    axes = {a for a, s in enumerate(layout.sbp) if isinstance(s, Split) and s.dim in dims}
    here = pl.coord(rank)
    return [q for q in pl.flat_ranks if all(a in axes or x == y for a, (x, y) in enumerate(zip(pl.coord(q), here)))]


_MOVE_KEY = zlib.crc32(b"roll")  # its messages' key (`Communicator.exchange`), the same in every process


def exchange_moved(x: torch.Tensor, out: torch.Tensor, src_layout: Layout, in_shape: tuple, dst_layout: Layout,
                   out_shape: tuple, moves: tuple, rank: int) -> torch.Tensor:
    """`out` (this rank's output shard) filled with the pieces that land in it: its own copied, its peers'
    received, one message per peer (the pieces flattened in order)."""
    rank_specific("pieces moved between particular ranks (a split dim's rows reordered)")
    sends, recvs, places = {}, {}, {}
    for q in peers(src_layout, {d for d, _, _ in moves}, rank):
        if q == rank:
            for a, b in moved_pieces(src_layout, in_shape, dst_layout, out_shape, moves, rank, rank):
                slice_box(out, b).copy_(slice_box(x, a))
            continue
        given = moved_pieces(src_layout, in_shape, dst_layout, out_shape, moves, rank, q)
        if given:
            sends[q] = torch.cat([slice_box(x, a).reshape(-1) for a, _ in given])
        taken = moved_pieces(src_layout, in_shape, dst_layout, out_shape, moves, q, rank)
        if taken:
            recvs[q], places[q] = ((sum(numel(b) for _, b in taken),), x.dtype), taken
    if sends or recvs:
        for q, got in context.current().exchange(sends, recvs, device=x.device, key=_MOVE_KEY).items():
            at = 0
            for _, b in places[q]:
                slice_box(out, b).copy_(got[at:at + numel(b)].reshape(sizes(b)))
                at += numel(b)
    return out


def moved_cost(src_layout: Layout, in_shape: tuple, dst_layout: Layout, out_shape: tuple, moves: tuple,
               itemsize: int) -> tuple:
    """What `exchange_moved` receives per global rank, and its latency terms: as a point-to-point conversion's
    (`boxing/exchange.py`), the most peers a rank receives from or sends to."""
    ranks = src_layout.placement.flat_ranks
    recv, hears, tells = [0] * (max(ranks) + 1), dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
    for r in ranks:
        for q in peers(src_layout, {d for d, _, _ in moves}, r):
            n = sum(numel(b) for _, b in moved_pieces(src_layout, in_shape, dst_layout, out_shape, moves, q, r)) \
                if q != r else 0
            if n:
                recv[r] += n * itemsize
                hears[r] += 1
                tells[q] += 1
    if not any(recv):
        return (), 0
    return tuple(recv), max(max(hears.values()), max(tells.values()))
