"""The cost model in time (issue 38): a link model (alpha per launch, beta per byte, per link class, and a
compute rate) prices boxing steps and op decisions; `gt.calibrate` measures one; the simulator's default is
bandwidth only, so the textbook plans the other tests count stay what they are.

Under gloo's model the issue's cases come out as a gloo job wants them: `linear` forward+backward makes no
collective (the weight's gradient stays Partial for the bucket, as DTensor's), a matmul of 2 rows on 4 ranks
is not moved onto 2 of them to save bytes, and a tiny conversion takes one launch over several messages.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor import boxing
from globaltensor.ops import decide, dispatch
from globaltensor.runtime import topology as T

B, P = gt.broadcast, gt.partial_sum


def test_defaults_and_across_cost_are_the_betas(monkeypatch):
    """One mechanism: a byte between nodes costs what the betas say (8x by default), for every backend's
    default; the simulator's has no alpha and no compute term (the textbook's bytes decide)."""
    for model in (T.SIMULATOR, T.GLOO_CPU, T.NVLINK_INFINIBAND):
        assert model.across_cost == pytest.approx(8.0)
        assert model.source
    assert T.SIMULATOR.inside.alpha == T.SIMULATOR.across.alpha == T.SIMULATOR.flop == 0
    assert T.default_for("gloo") is T.SIMULATOR  # conftest: the suite counts the textbook's bytes on gloo too
    monkeypatch.delenv("GT_LINK_MODEL")
    assert T.default_for("sim") is T.SIMULATOR
    assert T.default_for("gloo") is T.GLOO_CPU and T.default_for("nccl") is T.NVLINK_INFINIBAND
    monkeypatch.setenv("GT_LINK_MODEL", "gloo")
    assert T.default_for("sim") is T.GLOO_CPU
    monkeypatch.setenv("GT_LINK_MODEL", "fast")
    with pytest.raises(ValueError, match="GT_LINK_MODEL"):
        T.default_for("sim")
    assert T.Topology(2).across_cost == T.in_force().across_cost
    with pytest.raises(ValueError, match="alpha"):
        gt.Link(-1.0, 1e-9)
    with pytest.raises(ValueError, match="flop"):
        gt.LinkModel(gt.Link(0, 1e-9), gt.Link(0, 1e-9), flop=-1)


def test_a_conversion_costs_alpha_per_launch_plus_beta_per_busiest_byte():
    """S(0) -> B of a [6, 8] float tensor over 3 ranks: one all-gather, each rank receiving 2/3 of 192 bytes:
    time = alpha + beta * 128, in integer ticks; across nodes (2 ranks a node) the group spans them, so
    the across link's alpha and beta."""
    def body():
        gt.link_model(T.GLOO_CPU)
        p = gt.placement("cpu", [0, 1, 2])
        bill = decide.conversion_cost(gt.Layout(p, (gt.split(0),)), gt.Layout(p, (B,)), (6, 8), torch.float32)
        return bill, p.axis_kind
    for rpn, kind in ((None, "inside"), (2, "across")):
        bill, kinds = gt.launch(body, 3, ranks_per_node=rpn)[0]
        link = T.GLOO_CPU.link(kind)
        assert kinds == (kind,)
        assert bill.bytes == (128, 128, 128) and bill.collectives == 1
        assert bill.time() == T.ticks(link.alpha) + T.ticks(link.beta) * 128
        assert T.GLOO_CPU.seconds(bill.time()) == pytest.approx(link.alpha + 128 * link.beta)


def test_a_model_in_force_is_a_worlds_and_clears_the_caches():
    """gt.link_model puts a model in force (every cached route and decision was priced by another: cleared);
    the next world starts on its backend's default again."""
    def body():
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.ones(4, 4), p, gt.split(0))
        _ = x + x
        before = dispatch.cache_size()
        old = gt.link_model(T.GLOO_CPU)
        return old, before, gt.link_model(), dispatch.cache_size()
    old, before, now, size = gt.launch(body, 2)[0]
    assert old is T.SIMULATOR and now is T.GLOO_CPU and before > 0 and size == 0
    assert gt.launch(lambda: gt.link_model(), 2)[0] is T.SIMULATOR


def _linear_backward(model):
    def body():
        if model is not None:
            gt.link_model(model)
        p = gt.placement("cpu", [0, 1])
        torch.manual_seed(0)
        xf, wf = torch.randn(8, 8), torch.randn(8, 8)
        x = gt.to_global(xf, p, gt.split(0))
        w = gt.to_global(wf, p, B).requires_grad_()
        with gt.comm_log() as log:
            F.linear(x, w).sum().backward()
        ref = wf.clone().requires_grad_()
        F.linear(xf, ref).sum().backward()
        torch.testing.assert_close(w.grad.full_tensor(), ref.grad)
        return [(e.kind, e.recv_bytes) for e in log.events], w.grad.sbp
    return gt.launch(body, 2)


def test_linear_forward_backward_makes_no_collective_under_gloos_model():
    """The issue's case (bench/dispatch.py, 3.6x DTensor's time on gloo): x S(0) [8, 8], w B. By bytes alone
    the weight's gradient mm(grad^T, x) takes an all-to-all of x (64 B) inside the backward over the 128 B
    reduce-scatter its Partial owes; under gloo's model the Partial's reduction goes with the gradient bucket
    (no launch of its own), the all-to-all would launch now: the gradient stays Partial, no collective."""
    for events, sbp in _linear_backward(T.GLOO_CPU):
        assert events == [] and sbp == (P,)
    for events, sbp in _linear_backward(None):  # the simulator's bandwidth-only default: the fewest bytes
        assert events == [("all_to_all", 64)] and sbp == (gt.split(1),)


def _rows_matmul(model):
    def body():
        if model is not None:
            gt.link_model(model)
        p = gt.placement("cpu", [0, 1, 2, 3])
        torch.manual_seed(0)
        xf, wf = torch.randn(2, 512, dtype=torch.float64), torch.randn(512, 512, dtype=torch.float64)
        x = gt.to_global(xf, p, gt.split(1))
        w = gt.to_global(wf, p, B)
        with gt.comm_log() as log:
            y = x @ w
        torch.testing.assert_close(y.full_tensor(), xf @ wf)
        return y.sbp, [(e.kind, e.recv_bytes) for e in log.events], tuple(y.to_local().shape)
    return gt.launch(body, 4)


def test_idle_ranks_cost_their_compute():
    """x [2, 512] (fp64) split on its columns over 4 ranks times a whole w [512, 512]. Fewest bytes: an
    all-to-all of x into its 2 rows (rank 0 receives 3,072 B), leaving ranks 2 and 3 idle while 0 and 1 each
    compute half the product. Under gloo's model (50 GFLOP/s) that half is 0.52 MFLOP, 10.5 us (+ 3.1 us of
    bytes), against 5.2 us on every rank for a quarter of the sum (P, its reduction owed: 6 KB, 6.1 us): the
    work stays on all 4 ranks, and the output is what the matmul computes (one device's values)."""
    results = _rows_matmul(T.GLOO_CPU)
    for sbp, events, shape in results:
        assert sbp == (P,) and events == [] and shape == (2, 512)
    results = _rows_matmul(None)
    assert results[0][0] == (gt.split(0),) and results[0][1] == [("all_to_all", 3072)]
    assert [shape for _, _, shape in results] == [(1, 512), (1, 512), (0, 512), (0, 512)]  # 2 of 4 idle


def test_the_planner_trades_bytes_for_launches_only_under_a_timed_model():
    """S(0) over 3 ranks [3] int64 to B on rank 0 alone: the bound is 16 bytes on rank 0 (two messages);
    under gloo's model (alpha 50 us = 50 kB at 1 ns/B) one all-gather over the 3 ranks (48 bytes, one launch)
    and a local pick are quicker."""
    def body(model):
        gt.link_model(model)
        src = gt.Layout(gt.placement("cpu", [0, 1, 2]), (gt.split(0),))
        dst = gt.Layout(gt.placement("cpu", [0]), (B,))
        route = boxing.route(src, dst, (3,), torch.int64)
        return list(route.recv_bytes), [s.primitive for s in route.steps if s.latency]
    assert gt.launch(body, 3, args=(T.SIMULATOR,))[0] == ([16, 0, 0], ["send_recv"])
    assert gt.launch(body, 3, args=(T.GLOO_CPU,))[0] == ([16, 16, 16], ["all_gather"])


@pytest.mark.parametrize("ranks_per_node", [None, 2])
def test_calibrate_on_the_simulator_fits_and_installs_one_model(ranks_per_node):
    """A 2x2 mesh: per axis a fitted link of its class; every rank gets the same model (the slowest rank's
    times), it is in force after, and its source says the times are the simulator's."""
    def body():
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        c = gt.calibrate(p, sizes=(64, 1 << 16), repeats=2)
        return c, gt.link_model(), p.axis_kind
    got = gt.launch(body, 4, ranks_per_node=ranks_per_node)
    c, now, kinds = got[0]
    assert all(r[0].model == c.model for r in got) and now == c.model
    assert tuple(k for k, _ in c.axes) == kinds
    assert kinds == (("across", "inside") if ranks_per_node else ("inside", "inside"))
    assert all(link.beta > 0 and link.alpha >= 0 for _, link in c.axes)
    assert "simulator" in c.model.source and c.model.flop > 0
    assert len(c.samples) == 2 and all(len(s) == 4 for s in c.samples)
    assert "axis 1 (inside)" in str(c)


def _calibrate_gloo():
    p = gt.placement("cpu", [0, 1])
    return gt.calibrate(p, sizes=(64, 1 << 16), repeats=2).model


def test_calibrate_on_gloo_processes():
    models = gt.launch(_calibrate_gloo, 2, backend="gloo")
    assert models[0] == models[1] and "gloo" in models[0].source
    assert models[0].inside.beta > 0


def test_calibrate_refuses_bad_arguments():
    def body():
        p = gt.placement("cpu", [0, 1])
        with pytest.raises(ValueError, match="two different sizes"):
            gt.calibrate(p, sizes=(64, 64))
        with pytest.raises(TypeError, match="placement"):
            gt.calibrate([0, 1])
    gt.launch(body, 2)


def _linear_events():
    p = gt.placement("cpu", [0, 1])
    torch.manual_seed(0)
    x = gt.to_global(torch.randn(8, 8), p, gt.split(0))
    w = gt.to_global(torch.randn(8, 8), p, B).requires_grad_()
    with gt.comm_log() as log:
        F.linear(x, w).sum().backward()
    return gt.link_model(), [(e.kind, e.recv_bytes) for e in log.events], w.grad.sbp


@pytest.mark.gloo
def test_gloo_processes_decide_by_gloos_model_by_default(monkeypatch):
    """Without the suite's GT_LINK_MODEL=sim, a gloo job puts gloo's model in force: linear forward+backward
    makes no collective there (the all-to-all the simulator's default takes is 64 B but one more launch)."""
    monkeypatch.delenv("GT_LINK_MODEL")
    for model, events, sbp in gt.launch(_linear_events, 2, backend="gloo"):
        assert model == T.GLOO_CPU and events == [] and sbp == (P,)
