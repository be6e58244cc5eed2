"""Helpers for the boxing tests: reproducible shards (Partial ones included) and independent oracles.

Nothing here uses the library's shard arithmetic or boxing: shards come from
numpy.array_split over element ids, values from reducing the last mesh axis first.
"""
from __future__ import annotations

import math
from functools import reduce

import numpy as np
import torch

import globaltensor as gt

NP_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def ids_held(placement: gt.Placement, sbp, shape, rank: int) -> set[int]:
    """Element ids (row-major) rank holds under sbp, Partial read as Broadcast; empty outside."""
    if placement.coord(rank) is None:
        return set()
    out = np.arange(math.prod(shape)).reshape(shape)
    coord = placement.coord(rank)
    for axis, s in enumerate(sbp):
        if isinstance(s, gt.Split):
            out = np.array_split(out, placement.shape[axis], axis=s.dim)[coord[axis]]
    return set(out.reshape(-1).tolist())


def local_shape(placement, sbp, shape, rank):
    out = np.empty(shape, dtype=np.int8)
    coord = placement.coord(rank)
    for axis, s in enumerate(sbp):
        if isinstance(s, gt.Split):
            out = np.array_split(out, placement.shape[axis], axis=s.dim)[coord[axis]]
    return out.shape


def random_locals(placement, sbp, shape, seed: int, dtype=torch.int64) -> dict[int, np.ndarray]:
    """Per-rank shards with independent random values on Partial axes (replicated along B axes)."""
    out = {}
    for r in placement.flat_ranks:
        c = placement.coord(r)
        key = tuple(0 if isinstance(s, gt.Broadcast) else x for s, x in zip(sbp, c))
        rng = np.random.default_rng([seed, *key])
        ls = local_shape(placement, sbp, shape, r)
        if dtype.is_floating_point:
            out[r] = rng.standard_normal(ls)
        else:
            out[r] = rng.integers(-50, 50, ls)
    return out


def value(placement, sbp, locals_by_rank: dict[int, np.ndarray]) -> np.ndarray:
    """The global value: concatenate / pick / reduce the last mesh axis first."""
    level = {placement.coord(r): np.asarray(t) for r, t in locals_by_rank.items()}
    for axis in reversed(range(placement.ndim)):
        s = sbp[axis]
        nxt = {}
        for c in dict.fromkeys(k[:axis] for k in level):
            parts = [level[c + (i,)] for i in range(placement.shape[axis])]
            if isinstance(s, gt.Split):
                nxt[c] = np.concatenate(parts, axis=s.dim)
            elif isinstance(s, gt.Broadcast):
                nxt[c] = parts[0]
            else:
                nxt[c] = reduce(NP_REDUCE[s.op], parts)
        level = nxt
    return level[()]


def make(placement, sbp, shape, seed, dtype=torch.int64, requires_grad=False):
    """This rank's GlobalTensor built from `random_locals` (call inside a launched rank)."""
    locs = random_locals(placement, sbp, shape, seed, dtype)
    r = gt.rank()
    local = torch.from_numpy(np.array(locs[r])).to(dtype) if r in locs else torch.empty((0,), dtype=dtype)
    if requires_grad:
        local.requires_grad_(True)
    return gt.from_local(local, placement, sbp, shape=shape), local


def lower_bound(src_p, src_sbp, dst_p, dst_sbp, shape, itemsize) -> dict[int, int]:
    """Per rank: bytes of the target it must receive (Partial-free source).

    A Partial target's group (same shard, other partial coordinates) needs only
    what none of its members holds; it is charged to the member at partial coordinate 0.
    """
    pa = [a for a, s in enumerate(dst_sbp) if isinstance(s, gt.Partial)]
    out = {}
    for r in dst_p.flat_ranks:
        c = dst_p.coord(r)
        if any(c[a] for a in pa):
            out[r] = 0
            continue
        members = [q for q in dst_p.flat_ranks
                   if all(dst_p.coord(q)[a] == x for a, x in enumerate(c) if a not in pa)]
        have = set().union(*(ids_held(src_p, src_sbp, shape, q) for q in members))
        out[r] = len(ids_held(dst_p, dst_sbp, shape, r) - have) * itemsize
    return out


def all_reduce_bound(src_p, src_sbp, dst_p, dst_sbp, shape, itemsize) -> int:
    """Total bytes of: all-reduce every partial axis in place, then the lower-bound move to the target."""
    total = 0
    for axis, s in enumerate(src_sbp):
        if not isinstance(s, gt.Partial):
            continue
        n = src_p.shape[axis]
        for r in src_p.flat_ranks:
            m = math.prod(local_shape(src_p, src_sbp, shape, r))
            chunk = np.array_split(np.arange(m), n)[src_p.coord(r)[axis]].size
            total += ((n - 1) * chunk + (m - chunk)) * itemsize
    pf = tuple(gt.broadcast if isinstance(s, gt.Partial) else s for s in src_sbp)
    return total + sum(lower_bound(src_p, pf, dst_p, dst_sbp, shape, itemsize).values())
