"""Every 1-D pair of {S0, S1, B, P} and every 2-D pair on a 2x2 mesh, in real gloo processes.

One launch runs them all (spawning is the slow part); shapes are uneven and
one dim is smaller than the mesh, so empty shards and uneven all-to-alls occur.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import globaltensor as gt
from globaltensor import boxing
from boxing_support import make, random_locals, value

S0, S1, B, P = gt.split(0), gt.split(1), gt.broadcast, gt.partial_sum
LINE = gt.placement("cpu", [0, 1, 2, 3])
SQUARE = gt.placement("cpu", [[0, 1], [2, 3]])
PAIRS = (
    [(LINE, (a,), LINE, (b,), (5, 3)) for a, b in itertools.product([S0, S1, B, P], repeat=2)]
    + [(SQUARE, a, SQUARE, b, (5, 3))
       for a, b in itertools.product(itertools.product([S0, S1, B, P], repeat=2), repeat=2)]
    + [  # across placements, Partial max/min included
        (gt.placement("cpu", [0, 1]), (S0,), gt.placement("cpu", [1, 2, 3]), (S1,), (5, 7)),
        (SQUARE, (S0, S1), gt.placement("cpu", [3, 1]), (B,), (5, 3)),
        (SQUARE, (gt.partial("max"), S1), gt.placement("cpu", [2, 3]), (S0,), (3, 5)),
        (gt.placement("cpu", [2, 3]), (B,), SQUARE, (gt.partial("min"), S0), (6, 2)),
        (LINE, (P,), gt.placement("cpu", [[3], [0]]), (S1, B), (4, 5)),
        (gt.placement("cpu", [1]), (B,), gt.placement("cpu", [[0, 2], [3, 1]]), (B, S0), (3, 4)),  # broadcast
        # all-to-alls whose mesh order is not rank order (torch orders a group by rank)
        (gt.placement("cpu", [2, 0, 3, 1]), (S0,), gt.placement("cpu", [2, 0, 3, 1]), (S1,), (7, 9)),
        (gt.placement("cpu", [[3, 1], [0, 2]]), (S1, S0), gt.placement("cpu", [[3, 1], [0, 2]]), (S1, S1), (5, 7)),
    ]
)


def run_pairs():
    """Per pair: (bytes the communicator counted, bytes the route predicts, the target shard)."""
    out = []
    for i, (ps, ss, pd, ds, shape) in enumerate(PAIRS):
        x, _ = make(ps, ss, shape, seed=i)
        with gt.comm_log() as log:
            y = x.to_global(pd, ds)
        route = boxing.route(x.global_layout, y.global_layout, shape, x.dtype)
        local = y.to_local().numpy().copy() if gt.rank() in pd else None
        out.append((log.recv_bytes, route.recv_bytes_of(gt.rank()), local))
    return out


def check_pairs(out, pairs):
    for i, (ps, ss, pd, ds, shape) in enumerate(pairs):
        what = f"pair {i}: {ps} {ss} -> {pd} {ds}, shape {shape}"
        for r in range(len(out)):
            assert out[r][i][0] == out[r][i][1], f"{what}: rank {r} counted {out[r][i][0]}, route {out[r][i][1]}"
        before = value(ps, ss, random_locals(ps, ss, shape, i))
        after = value(pd, ds, {r: out[r][i][2] for r in pd.flat_ranks})
        np.testing.assert_array_equal(after, before, err_msg=what)


def run_pairs_both_gathers():
    """Every pair twice: all-gathers by gloo's own collective (small ones), then as sends (large ones)."""
    from globaltensor.runtime import dist
    small = run_pairs()
    saved, dist.GLOO_SENDS_FROM_BYTES = dist.GLOO_SENDS_FROM_BYTES, 0
    try:
        return small, run_pairs()
    finally:
        dist.GLOO_SENDS_FROM_BYTES = saved


@pytest.mark.gloo
def test_every_pair_under_gloo():
    out = gt.launch(run_pairs_both_gathers, 4, backend="gloo")
    check_pairs([small for small, _ in out], PAIRS)
    check_pairs([sends for _, sends in out], PAIRS)
