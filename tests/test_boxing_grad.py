"""Boxing is differentiable: gradients through to_global equal single-device torch (float64).

The loss is computed from `full_tensor()` (the same on every rank), so each
source shard's gradient must be the single-device gradient restricted to that
shard (Partial axes: the whole of it, the dual of Partial being Broadcast).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor import boxing
from boxing_support import make, random_locals, value
from strategies import expected_shard
from test_boxing_props import conversions

S0, S1, B, P = gt.split(0), gt.split(1), gt.broadcast, gt.partial_sum
F64 = torch.float64
LINE = gt.placement("cpu", [0, 1, 2])
SQUARE = gt.placement("cpu", [[0, 1], [2, 3]])


def _grad_body(ps, ss, pd, ds, shape, seed):
    x, local = make(ps, ss, shape, seed, dtype=F64, requires_grad=True)
    y = x.to_global(pd, ds)
    w = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal(shape))
    full = y.full_tensor()
    loss = (full ** 2 * w).sum() if gt.rank() in pd else full.sum()  # every rank runs backward (SPMD)
    loss.backward()
    return local.grad.numpy().copy() if gt.rank() in ps else None


def _check(ps, ss, pd, ds, shape, world, seed=0):
    grads = gt.launch(_grad_body, world, args=(ps, ss, pd, ds, shape, seed))
    t = torch.from_numpy(value(ps, ss, random_locals(ps, ss, shape, seed, F64))).requires_grad_(True)
    w = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal(shape))
    (t ** 2 * w).sum().backward()  # the single-device program
    for r in ps.flat_ranks:
        np.testing.assert_allclose(grads[r], expected_shard(t.grad.numpy(), ps, ss, r), rtol=1e-12, atol=1e-12,
                                   err_msg=f"rank {r}: {ss} on {ps} -> {ds} on {pd}")


CASES = [  # each primitive forward (and so its dual backward) at least once
    (LINE, (S0,), LINE, (B,), "all_gather"),
    (LINE, (S0,), LINE, (S1,), "all_to_all"),
    (LINE, (P,), LINE, (S1,), "reduce_scatter"),
    (LINE, (P,), LINE, (B,), "all_reduce"),
    (LINE, (B,), LINE, (S1,), "slice"),
    (LINE, (B,), LINE, (P,), "fill"),
    (SQUARE, (S0, S1), SQUARE, (P, S1), "pad"),
    (SQUARE, (S0, S1), SQUARE, (S1, S0), "send_recv"),
    (SQUARE, (S0, S0), SQUARE, (B, S0), "send_recv"),
    (SQUARE, (P, S1), gt.placement("cpu", [3, 4]), (S0,), None),
    (gt.placement("cpu", [0, 1]), (S0,), gt.placement("cpu", [2, 3, 4]), (S1,), "send_recv"),
    (SQUARE, (S1, B), gt.placement("cpu", [4, 1]), (P,), None),
]


@pytest.mark.parametrize("ps,ss,pd,ds,prim", CASES, ids=[f"{c[1]}->{c[3]}" for c in CASES])
def test_gradient_of_each_primitive_matches_single_device(ps, ss, pd, ds, prim):
    shape = (5, 3)
    if prim is not None:
        route = boxing.route(gt.Layout(ps, ss), gt.Layout(pd, ds), shape, F64)
        assert prim in [s.primitive for s in route.steps], route.explain()
    world = max(ps.flat_ranks + pd.flat_ranks) + 1
    _check(ps, ss, pd, ds, shape, world)


def _sum_only(sbps):
    return tuple(P if isinstance(s, gt.Partial) else s for s in sbps)


@given(case=conversions(max_ranks=6), seed=st.integers(0, 2**16))
def test_gradients_of_random_conversions_match_single_device(case, seed):
    world, ps, ss, pd, ds, shape = case
    _check(ps, _sum_only(ss), pd, _sum_only(ds), shape, world, seed)


def test_partial_stays_partial_in_forward():
    """B -> P keeps the value on one rank of the axis (not a Broadcast in disguise); P -> P is free."""
    def body():
        x = gt.to_global(torch.ones(2), LINE, B)
        y = x.to_global(LINE, P)
        with gt.comm_log() as log:
            z = y.to_global(LINE, P)
        return y.to_local().tolist(), log.events, z is y
    out = gt.launch(body, 3)
    assert [o[0] for o in out] == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert all(o[1] == [] and o[2] for o in out)
