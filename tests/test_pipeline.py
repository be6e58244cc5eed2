"""Pipeline parallelism from placement: the GPT split into stages by its plan, GPipe and 1F1B.

Every case trains against the same program on one device (fp64, 1e-10) and counts what crosses the
stage boundaries exactly: per micro-batch, the activation forward and its gradient backward at each
boundary, and the tied embedding/head weight sent to the last stage and its gradient sent back.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, pp_plan, tp_plan, zero_plan
from globaltensor.pipeline import schedule_actions

B = gt.broadcast
F64 = 8
VOCAB, T, D = 32, 8, 16


def _cfg(n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=4, n_embd=D)


def _data(batch: int):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, T), generator=g), torch.randint(0, VOCAB, (batch, T), generator=g)


def loss_fn(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


def reference(n_layer: int, batch: int, steps: int):
    torch.manual_seed(0)
    model = GPT(_cfg(n_layer)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = _data(batch)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _stages(n_stages: int, stage_mesh: tuple) -> list:
    per = math.prod(stage_mesh)
    return [gt.placement("cpu", np.arange(s * per, (s + 1) * per).reshape(stage_mesh).tolist())
            for s in range(n_stages)]


def pipelined(n_stages, n_layer, kind, micro, batch, steps, inner="none", stage_mesh=(1,)):
    stages = _stages(n_stages, stage_mesh)
    nd = len(stage_mesh)
    inner_plan = {"none": None, "tp": lambda: tp_plan(1, 2), "zero": lambda: zero_plan(0, 1),
                  "zero2": lambda: zero_plan(0, 1, reshard_after_forward=False)}[inner]
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(n_layer)).double(), stages[0],
                         pp_plan(stages, n_layer, inner_plan() if inner_plan else None))
    data_sbp = dp_batch(0, nd) if stage_mesh[0] > 1 else (B,) * nd
    pipe = gt.Pipeline(model, microbatches=micro, schedule=kind, loss_fn=loss_fn, input_sbp=data_sbp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = _data(batch)
    losses, events = [], []
    for _ in range(steps):
        with gt.comm_log() as log:
            loss = pipe.step(x, t)
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        events.append(log.events)
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    held = {k: gt.rank() in v.placement for k, v in model.state_dict().items()}
    return losses, state, held, events, pipe.peak_in_flight, pipe.stage


def _check_values(results, want_losses, want_state):
    for losses, state, held, *_ in results:
        got = [x for x in losses if x is not None]
        if got:
            np.testing.assert_allclose(got, want_losses, rtol=0, atol=1e-10)
        for k, v in want_state.items():
            if held[k]:
                torch.testing.assert_close(state[k], v, rtol=0, atol=1e-10, msg=k)
    assert sum(1 for r in results if any(x is not None for x in r[0])) >= 1


@pytest.mark.parametrize("n_stages", [2, 4])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpt_pipeline_trains_as_one_device_and_sends_only_the_boundaries(n_stages, kind):
    n_layer, micro, batch, steps = 4, 4, 8, 20
    want_losses, want_state = reference(n_layer, batch, steps)
    results = gt.launch(pipelined, n_stages, args=(n_stages, n_layer, kind, micro, batch, steps))
    _check_values(results, want_losses, want_state)
    act = batch // micro * T * D * F64      # one micro-batch's activation (or its gradient)
    wte = VOCAB * D * F64                   # the tied embedding/head weight (or its gradient)
    for losses, state, held, events, peak, stage in results:
        got = sum(e.recv_bytes for e in events[-1])
        assert {e.kind for e in events[-1]} == {"send_recv"}
        want = micro * act                                  # activations in (or gradients in, stage 0)
        if 0 < stage < n_stages - 1:
            want = 2 * micro * act                          # both: activations in, gradients in
        if stage == n_stages - 1:
            want += micro * wte                             # the head's weight, each micro-batch
        if stage == 0:
            want += micro * wte                             # the head's weight gradient, back
        assert got == want, (stage, got, want)
        assert peak == (micro if kind == "gpipe" else min(n_stages - stage, micro))


def test_pipeline_x_data_x_tensor_on_eight_ranks():
    """PP=2 x DP=2 x TP=2: each stage a 2x2 data x tensor mesh with Megatron TP inside."""
    n_layer, steps = 2, 4
    want_losses, want_state = reference(n_layer, 8, steps)
    results = gt.launch(pipelined, 8, args=(2, n_layer, "1f1b", 2, 8, steps, "tp", (2, 2)))
    _check_values(results, want_losses, want_state)


@pytest.mark.parametrize("inner", ["zero", "zero2"])
def test_pipeline_x_zero(inner):
    """PP=2 x ZeRO-3 (and ZeRO-2) on 2 ranks per stage."""
    n_layer, steps = 2, 4
    want_losses, want_state = reference(n_layer, 8, steps)
    results = gt.launch(pipelined, 4, args=(2, n_layer, "1f1b", 2, 8, steps, inner, (2,)))
    _check_values(results, want_losses, want_state)


@settings(deadline=None, max_examples=max(4, settings.default.max_examples // 4))  # each example trains 2-3 ranks
@given(n_stages=st.integers(2, 3), extra_layers=st.integers(0, 2), micro=st.integers(1, 5),
       batch=st.integers(3, 7), kind=st.sampled_from(["gpipe", "1f1b"]))
def test_pipeline_hypothesis_splits_microbatches_schedules(n_stages, extra_layers, micro, batch, kind):
    """Uneven layer counts per stage (earlier stages take the extra blocks), micro-batch counts that do
    not divide the batch (tensor_split's sizes, differing by one; each micro-batch's loss is weighted
    by its share of the batch, so the step equals one pass over the whole batch), both schedules."""
    micro = min(micro, batch)
    n_layer = n_stages + extra_layers
    want_losses, want_state = reference(n_layer, batch, 2)
    results = gt.launch(pipelined, n_stages, args=(n_stages, n_layer, kind, micro, batch, 2))
    _check_values(results, want_losses, want_state)


def test_schedules_are_data():
    acts = schedule_actions("1f1b", 3, 4)
    assert acts[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert acts[2] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert schedule_actions("gpipe", 2, 2) == [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]] * 2
    with pytest.raises(ValueError, match="schedule"):
        schedule_actions("zigzag", 2, 2)


def _failing(kind):
    stages = _stages(2, (1,))
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(2)).double(), stages[0], pp_plan(stages, 2))

    def bad_loss(out, tgt):
        if gt.rank() == 1:
            raise RuntimeError("stage 1 broke")
        return loss_fn(out, tgt)
    micro = 2 if kind == "raise" or gt.rank() == 0 else 3    # "mismatch": the ranks disagree on the schedule
    pipe = gt.Pipeline(model, microbatches=micro, schedule="1f1b", loss_fn=bad_loss if kind == "raise" else loss_fn)
    return pipe.step(*_data(4))


def test_a_failing_stage_and_a_schedule_mismatch_end_with_an_error():
    with pytest.raises(Exception, match="stage 1 broke"):
        gt.launch(_failing, 2, args=("raise",), timeout=20)
    with pytest.raises(Exception, match="send_recv|never completed|mismatch"):
        gt.launch(_failing, 2, args=("mismatch",), timeout=20)


def test_pipeline_bad_input():
    def run():
        stages = _stages(2, (1,))
        model = gt.to_global(GPT(_cfg(2)).double(), stages[0], pp_plan(stages, 2))
        with pytest.raises(ValueError, match="microbatches"):
            gt.Pipeline(model, microbatches=0, loss_fn=loss_fn)
        with pytest.raises(ValueError, match="schedule"):
            gt.Pipeline(model, microbatches=2, schedule="zigzag", loss_fn=loss_fn)
        with pytest.raises(TypeError, match="loss_fn"):
            gt.Pipeline(model, microbatches=2)
    gt.launch(run, 2)


@pytest.mark.gloo
def test_pipeline_x_data_under_gloo():
    """PP=2 x DP=2 on 4 real processes, 1F1B."""
    want_losses, want_state = reference(2, 8, 3)
    results = gt.launch(pipelined, 4, args=(2, 2, "1f1b", 2, 8, 3, "none", (2,)), backend="gloo", timeout=120)
    _check_values(results, want_losses, want_state)
