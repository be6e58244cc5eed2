"""Pointwise/broadcasting rules, the dispatcher's contract (cache, plain tensors, fallback, in-place, errors)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor.ops import dispatch
from ops_support import check, chosen_is_cheapest, meshes, mesh_placement, sbps_for

aten = torch.ops.aten
D = torch.float64

BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - 2 * b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b.abs() + 1), "where": lambda a, b: torch.where(a > b, a, b),
    "masked_fill": lambda a, b: a.masked_fill(b > 0, 0.0).masked_fill(b < -1, -3.0),
    "gelu_mix": lambda a, b: F.gelu(a) * torch.sigmoid(b) + torch.relu(a - b).exp() - (a >= b).to(D),
    "maximum": lambda a, b: torch.maximum(a, b).tanh(),
    "floor_divide": lambda a, b: torch.floor_divide(a.detach() * 3, b.detach().abs() + 0.5) + torch.remainder(a, 0.7)
    * b,
}


@st.composite
def broadcast_pair(draw):
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    # b broadcasts against a: drop leading dims, set some dims to 1
    k = draw(st.integers(0, len(shape) - 1))
    bshape = tuple(1 if draw(st.booleans()) else s for s in shape[k:])
    sa = draw(sbps_for(mesh, shape, partial=True))
    sb = draw(sbps_for(mesh, bshape, partial=True))
    return mesh, shape, bshape, sa, sb


@given(broadcast_pair(), st.sampled_from(sorted(BINARY)))
def test_binary_broadcasting_matches_one_device(case, name):
    mesh, shape, bshape, sa, sb = case
    torch.manual_seed(0)
    a, b = torch.randn(shape, dtype=D), torch.randn(bshape, dtype=D)
    check(BINARY[name], [a, b], mesh, [sa, sb])


@given(st.sampled_from([(2,), (2, 2), (3,)]))
def test_partial_stays_partial_through_linear_ops_only(mesh):
    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(torch.ones(4, 3), p, (gt.partial_sum,) * len(mesh))
        return (x * 2 + x).sbp, (x - x.neg()).sbp, torch.exp(x).sbp, (x + 1).sbp
    lin, lin2, nonlin, plus1 = gt.launch(body, mesh_placement(mesh).size)[0]
    assert all(isinstance(s, gt.Partial) for s in lin + lin2)
    assert not any(isinstance(s, gt.Partial) for s in nonlin + plus1)


def test_scalar_add_to_partial_is_correct():
    def body():
        x = gt.to_global(torch.ones(3), gt.placement("cpu", [0, 1]), gt.partial_sum)
        return (x + 1).full_tensor(), x.masked_fill(torch.tensor([True, False, False]), 5.0).full_tensor()
    for a, b in gt.launch(body, 2):
        assert torch.equal(a, torch.full((3,), 2.0))
        assert torch.equal(b, torch.tensor([5.0, 1.0, 1.0]))


def test_plain_tensors_are_broadcast_and_checked():
    def body(bad):
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.arange(6.0).reshape(3, 2), p, gt.split(0))
        plain = torch.ones(3, 2) * (gt.rank() + 1 if bad else 1)
        return (x + plain).full_tensor()
    for r in gt.launch(body, 2, args=(False,)):
        assert torch.equal(r, torch.arange(6.0).reshape(3, 2) + 1)
    gt.check_replicated(True)
    try:
        with pytest.raises(ValueError, match="aten.add.Tensor.*differs between rank"):
            gt.launch(body, 2, args=(True,))
        gt.launch(body, 2, args=(False,))
    finally:
        gt.check_replicated(False)


def test_different_placements_are_an_error_naming_the_fix():
    def body():
        x = gt.to_global(torch.ones(2), gt.placement("cpu", [0, 1]), gt.broadcast)
        y = gt.to_global(torch.ones(2), gt.placement("cpu", [1, 0]), gt.broadcast)
        return x + y
    with pytest.raises(ValueError, match="different placements.*to_global"):
        gt.launch(body, 2)


def test_op_without_rule_falls_back_warns_once_and_is_counted():
    gt.reset_stats()
    dispatch._WARNED.discard("aten.median.default")

    def body():
        x = gt.to_global(torch.arange(6.0), gt.placement("cpu", [0, 1]), gt.split(0))
        a = torch.median(x)  # an op with no rule (an order statistic of the whole input)
        b = torch.median(x)
        return a.full_tensor(), b.sbp
    # recorded around the launch, in this thread: `catch_warnings` swaps process-wide state, which the simulated
    # ranks' threads entering it at once would leave another thread's way
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        results = gt.launch(body, 2)
    for full, sbp in results:
        assert torch.equal(full, torch.arange(6.0).median())
        assert sbp == (gt.broadcast,)
    assert sum("no SBP rule for aten.median" in str(m.message) for m in w) == 1
    assert gt.stats()["fallback"]["aten.median.default"] == 4  # 2 calls on 2 ranks


def test_inplace_keeps_target_layout():
    def body():
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        t = torch.arange(12.0).reshape(4, 3)
        x = gt.to_global(t, p, (gt.split(0), gt.split(1)))
        x.add_(gt.to_global(t, p, (gt.broadcast, gt.partial_sum)))
        x.mul_(2).exp_()
        y = gt.to_global(torch.ones(4, 3), p, (gt.partial_sum, gt.partial_sum))
        y.fill_(3.0)
        return x.sbp, x.full_tensor(), y.sbp, y.full_tensor()
    for sbp, full, ysbp, yfull in gt.launch(body, 4):
        t = torch.arange(12.0).reshape(4, 3)
        assert sbp == (gt.split(0), gt.split(1))
        torch.testing.assert_close(full, (4 * t).exp())
        assert ysbp == (gt.partial_sum, gt.partial_sum)
        assert torch.equal(yfull, torch.full((4, 3), 3.0))


def test_cache_hit_reuses_one_decision():
    def body():
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.ones(4, 2), p, gt.split(0))
        dispatch.clear_cache()
        before = dict(gt.stats()["decisions"])
        for _ in range(5):
            x = x * 1.5
        return gt.stats()["decisions"].get("aten.mul.Tensor", 0) - before.get("aten.mul.Tensor", 0)
    assert gt.launch(body, 2)[0] <= 2  # one decision (made by whichever rank ran first), never per call


@given(broadcast_pair())
def test_chosen_signature_is_cheapest(case):
    mesh, shape, bshape, sa, sb = case
    a, b = torch.randn(shape, dtype=D), torch.randn(bshape, dtype=D)
    chosen, best, n = chosen_is_cheapest(
        aten.mul.Tensor, lambda p: (gt.to_global(a, p, sa), gt.to_global(b, p, sb)), tuple(mesh))
    assert chosen == best and n >= 1


CASTS = {
    "float_double": lambda x: x.float().double() * 2,
    "to_int": lambda x: ((x * 3).to(torch.int64) + 1, x * 1),
    "type_as_bool": lambda x: (x.type_as(torch.ones(1, dtype=torch.float32)), x.to(torch.bool)),
    "half_sum": lambda x: x.to(torch.float16).sum(-1),
}


@given(meshes(), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.sampled_from(sorted(CASTS)), st.data())
def test_casts_match_one_device(mesh, shape, name, data):
    """Casts keep any split; a P input stays P only into a floating dtype (the parts round, so a low-precision
    dtype's tolerance)."""
    sbp = data.draw(sbps_for(mesh, tuple(shape), partial=True))
    torch.manual_seed(9)
    x = torch.randn(shape, dtype=D)
    check(CASTS[name], [x], mesh, [sbp], rtol=2e-3 if name == "half_sum" else 1e-6, atol=1e-2 if name == "half_sum"
          else 1e-6)


def test_casts_keep_partial_only_where_linear_or_monotone():
    def body():
        p = mesh_placement((2,))
        r = gt.rank()
        s = gt.from_local(torch.tensor([1.5, -2.5]), p, gt.partial_sum)
        m = gt.from_local(torch.tensor([1.5, -2.5]) * (r + 1), p, gt.partial("max"))
        # into a narrower float P stays P (its reduction is cheaper after the cast; s.double() reduces first,
        # in fp32, for half the bytes), into an int never
        return ((s.half().sbp, s.to(torch.int64).sbp, m.half().sbp, m.to(torch.int32).sbp),
                s.to(torch.int64).full_tensor(), m.to(torch.int32).full_tensor())
    sbps, ints, maxes = gt.launch(body, 2)[0]
    assert sbps[0] == (gt.partial_sum,) and sbps[2] == (gt.partial("max"),)
    assert not any(isinstance(x, gt.Partial) for x in sbps[1] + sbps[3])  # reduced before an int cast
    assert torch.equal(ints, torch.tensor([3, -5])) and torch.equal(maxes, torch.tensor([3, -2], dtype=torch.int32))


def test_is_pinned_is_answered_locally_on_every_rank():
    def body():
        p = gt.placement("cpu", [[2, 0]])  # rank 1 of 3 is outside
        x = gt.to_global(torch.randn(4, 3), p, (gt.partial_sum, gt.split(0)))
        with gt.comm_log() as log:
            pinned = x.is_pinned()
        return pinned, log.recv_bytes
    assert gt.launch(body, 3) == [(False, 0)] * 3
    assert "aten.is_pinned.default" not in gt.stats()["fallback"]
