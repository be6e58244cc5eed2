"""Pipeline parallelism from placement: the GPT split into stages by its plan, GPipe, 1F1B, interleaved 1F1B.

Every case trains against the same program on one device (fp64, 1e-10) and counts what crosses the
stage boundaries exactly: per micro-batch, the activation forward and its gradient backward at each
boundary, and the tied embedding/head weight sent to the last stage and its gradient sent back.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, pp_plan, tp_plan, zero_plan
from globaltensor.parallel.pipeline import schedule_actions

B = gt.broadcast
F64 = 8
VOCAB, T, D = 32, 8, 16


def _cfg(n_layer: int, tied_head: bool = True) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=4, n_embd=D, tied_head=tied_head)


def _data(batch: int):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, T), generator=g), torch.randint(0, VOCAB, (batch, T), generator=g)


def loss_fn(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


def reference(n_layer: int, batch: int, steps: int, foreach: bool = False, clip: float | None = None,
              tied_head: bool = True):
    """The losses and the final state of the same training on one device; with `clip`, the gradient
    norms clip_grad_norm_ returned too."""
    torch.manual_seed(0)
    model = GPT(_cfg(n_layer, tied_head)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    x, t = _data(batch)
    losses, norms = [], []
    for _ in range(steps):
        loss = loss_fn(model(x), t)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return (losses, state, norms) if clip is not None else (losses, state)


def _stages(n_stages: int, stage_mesh: tuple) -> list:
    per = math.prod(stage_mesh)
    return [gt.placement("cpu", np.arange(s * per, (s + 1) * per).reshape(stage_mesh).tolist())
            for s in range(n_stages)]


def pipelined(n_stages, n_layer, kind, micro, batch, steps, inner="none", stage_mesh=(1,), virtual=1,
              foreach=False, log_optimizer=False, tied_head=True, replay=False):
    """Returns (losses, state, held, events, peak micro-batches in flight, stage, forwards left in the last step):
    events per step, the pipeline step's collectives (and, with `log_optimizer`, the optimizer step's after them)."""
    stages = _stages(n_stages, stage_mesh)
    nd = len(stage_mesh)
    inner_plan = {"none": None, "tp": lambda: tp_plan(1, 2), "zero": lambda: zero_plan(0, 1),
                  "zero2": lambda: zero_plan(0, 1, reshard_after_forward=False)}[inner]
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(n_layer, tied_head)).double(), stages[0],
                         pp_plan(stages, n_layer, inner_plan() if inner_plan else None, virtual=virtual,
                                 tied_head=tied_head))
    data_sbp = dp_batch(0, nd) if stage_mesh[0] > 1 else (B,) * nd
    pipe = gt.Pipeline(model, microbatches=micro, schedule=kind, loss_fn=loss_fn, input_sbp=data_sbp, replay=replay)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    x, t = _data(batch)
    losses, events = [], []
    for _ in range(steps):
        with gt.comm_log() as log:
            loss = pipe.step(x, t)
        with gt.comm_log() as opt_log:
            opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        events.append(log.events + (opt_log.events if log_optimizer else []))
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    held = {k: gt.rank() in v.placement for k, v in model.state_dict().items()}
    return losses, state, held, events, pipe.peak_in_flight, pipe.stage, pipe.left_forwards


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
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_gpt_pipeline_trains_as_one_device_and_sends_only_the_boundaries(n_stages, kind):
    """Interleaved: two chunks (virtual stages) per stage, chunk c of stage s the virtual stage
    c * n_stages + s, so each stage receives at every chunk it enters (activations) and at every chunk
    whose output goes on (gradients)."""
    virtual = 2 if kind == "interleaved" else 1
    n_layer, micro, batch, steps = 4 * virtual, 4, 8, 20
    want_losses, want_state = reference(n_layer, batch, steps)
    results = gt.launch(pipelined, n_stages, args=(n_stages, n_layer, kind, micro, batch, steps, "none", (1,),
                                                   virtual))
    _check_values(results, want_losses, want_state)
    act = batch // micro * T * D * F64      # one micro-batch's activation (or its gradient)
    wte = VOCAB * D * F64                   # the tied embedding/head weight (or its gradient)
    last = n_stages * virtual - 1           # the last virtual stage
    for losses, state, held, events, peak, stage, _ in results:
        got = sum(e.recv_bytes for e in events[-1])
        assert {e.kind for e in events[-1]} == {"send_recv"}
        chunks = [c * n_stages + stage for c in range(virtual)]
        want = micro * act * (sum(vs > 0 for vs in chunks) + sum(vs < last for vs in chunks))
        if stage == n_stages - 1:
            want += wte                                     # the head's weight, once per step
        if stage == 0:
            want += wte                                     # its gradient summed over the micro-batches, back
        assert got == want, (stage, got, want)
        if kind == "gpipe":
            assert peak == micro
        elif kind == "1f1b":
            assert peak == min(n_stages - stage, micro)
        else:  # Megatron's warm-up: (p - s - 1) * 2 + (v - 1) * p forward chunks, then one more
            assert peak == min((n_stages - stage - 1) * 2 + (virtual - 1) * n_stages + 1, micro * virtual) / virtual


@pytest.mark.parametrize("n_stages, kind", [(2, "interleaved"), (4, "1f1b")])
def test_an_untied_head_is_stored_on_the_last_stage_and_never_moves(n_stages, kind):
    """GPTConfig(tied_head=False) with pp_plan(tied_head=False), the model torch.pipelining's stages are (it cannot
    tie across stages): the head's own weight lives on the last stage; only the activations and their gradients
    cross, and training equals the same untied model on one device."""
    virtual = 2 if kind == "interleaved" else 1
    n_layer, micro, batch, steps = 4 * virtual, 4, 8, 6
    want_losses, want_state = reference(n_layer, batch, steps, tied_head=False)
    assert "head.weight" in want_state
    results = gt.launch(pipelined, n_stages, args=(n_stages, n_layer, kind, micro, batch, steps, "none", (1,),
                                                   virtual, False, False, False))
    _check_values(results, want_losses, want_state)
    act = batch // micro * T * D * F64
    last = n_stages * virtual - 1
    for losses, state, held, events, peak, stage, _ in results:
        chunks = [c * n_stages + stage for c in range(virtual)]
        assert held["head.weight"] == (stage == n_stages - 1)
        assert {e.kind for e in events[-1]} == {"send_recv"}
        assert sum(e.recv_bytes for e in events[-1]) == micro * act * (
            sum(vs > 0 for vs in chunks) + sum(vs < last for vs in chunks))


def test_a_plan_that_lays_out_a_tied_weight_twice_differently_is_an_error():
    """pp_plan(tied_head=False) on the GPT as written (head tied to wte): the entry for head.weight names the tensor
    the plan already placed as wte.weight; it would be dropped unseen (the head then used on the first stage)."""
    def run():
        stages = _stages(2, (1,))
        with pytest.raises(ValueError, match=r"'head.weight' is the same tensor as 'wte.weight' \(tied\).*"
                                             r"tied_head=False"):
            gt.to_global(GPT(_cfg(4)), stages[0], pp_plan(stages, 4, tied_head=False))
        gt.to_global(GPT(_cfg(4)), stages[0], {"wte.weight": B, "head.weight": B})  # agreeing entries are fine
        return True
    assert all(gt.launch(run, 2))


def test_foreach_adamw_updates_every_stage_as_one_device():
    """torch.optim's foreach path (the default on CUDA) passes every parameter in one list, so a pipeline's
    lists span the stages' placements; each index is one parameter, on one placement."""
    want_losses, want_state = reference(2, 4, 3, foreach=True)
    _check_values(gt.launch(pipelined, 2, args=(2, 2, "1f1b", 2, 4, 3, "none", (1,), 1, True)),
                  want_losses, want_state)


def _clipped(stage_mesh, foreach, steps, clip, kind, inner):
    """A 2-stage GPT (2 blocks, one per stage; interleaved: 4, two chunks per stage; ZeRO-3 inside each stage
    with inner="zero"); each step torch's clip_grad_norm_, unchanged, between the backward and AdamW. kind
    "plain": no schedule, the model run whole as one global program. Returns (losses, state, held, norms,
    this rank's bytes the norms moved across stages per step, parameters on other stages, parameters)."""
    stages = _stages(2, stage_mesh)
    per, nd = math.prod(stage_mesh), len(stage_mesh)
    virtual = 2 if kind == "interleaved" else 1
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(2 * virtual)).double(), stages[0],
                         pp_plan(stages, 2 * virtual, zero_plan(0, 1) if inner == "zero" else None, virtual=virtual))
    data_sbp = dp_batch(0, nd) if stage_mesh[0] > 1 else (B,) * nd
    pipe = gt.Pipeline(model, microbatches=2, schedule="1f1b" if kind == "plain" else kind, loss_fn=loss_fn,
                       input_sbp=data_sbp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    x, t = _data(4)
    losses, norms, moved = [], [], []
    for _ in range(steps):
        if kind != "plain":
            loss = pipe.step(x, t)
        else:
            loss = loss_fn(model(gt.to_global(x, stages[0], data_sbp)), t)
            loss.backward()
        with gt.comm_log() as log:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach, error_if_nonfinite=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        norms.append(norm.item())  # on the union of the stages: every rank has it, as Megatron's all-reduce gives
        moved.append([(e.kind, e.recv_bytes) for e in log.events if len({r // per for r in e.group}) > 1])
        if stage_mesh == (1,):  # one rank per stage: nothing but the norms moves
            assert len(moved[-1]) == len(log.events)
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    held = {k: gt.rank() in v.placement for k, v in model.state_dict().items()}
    params = list(model.parameters())
    return losses, state, held, norms, moved, sum(gt.rank() not in q.placement for q in params), len(params)


@pytest.mark.parametrize("stage_mesh,foreach,kind,inner", [
    ((1,), True, "1f1b", "none"), ((1,), False, "plain", "none"), ((1,), True, "interleaved", "none"),
    ((2,), False, "1f1b", "none"), ((2,), True, "1f1b", "none"), ((2,), True, "1f1b", "zero")])
def test_clip_grad_norm_over_stages_equals_one_device(stage_mesh, foreach, kind, inner):
    """torch.nn.utils.clip_grad_norm_, unchanged (foreach and the for-loop, error_if_nonfinite=True), on a
    2-stage GPT (1F1B, interleaved, PP=2 x DP=2, PP=2 x ZeRO-3; and the same model run as a plain program
    whose parameters span two placements): each parameter's norm is a scalar on its stage, their stack runs
    on the union of the stages, and the coefficient, Broadcast there, scales each stage's gradients where
    they are.

    Bytes across stages per step and rank, counted exactly: stages of one rank: every parameter's norm,
    zero-filled onto the union and all-reduced together (one collective, 2(n-1)/n of 36 scalars: 288 bytes;
    68 interleaved; the lower bound, the other stage's norms, is half). Stages of two ranks: the 18 norms
    of the other stage, each from its peer (the lower bound, in one send per norm: not packed). Megatron
    moves one scalar per stage; see ops/span.py for why this is not that."""
    steps, clip = 3, 0.5
    n_layer = 4 if kind == "interleaved" else 2
    want_losses, want_state, want_norms = reference(n_layer, 4, steps, foreach=foreach, clip=clip)
    assert all(n > clip for n in want_norms)  # every step clips
    results = gt.launch(_clipped, 2 * math.prod(stage_mesh), args=(stage_mesh, foreach, steps, clip, kind, inner))
    _check_values(results, want_losses, want_state)
    for *_, norms, moved, elsewhere, total in results:
        np.testing.assert_allclose(norms, want_norms, rtol=0, atol=1e-10)
        assert total == {2: 36, 4: 68}[n_layer]
        for step in moved:
            if stage_mesh == (1,):
                assert step == [("all_reduce", total * F64)], step
            else:
                assert sum(b for _, b in step) == elsewhere * F64 == 18 * F64, step


def test_clip_grad_norm_error_if_nonfinite_raises_on_every_rank():
    """A non-finite gradient on the last stage: every rank knows the total norm, so every rank raises torch's error."""
    def run():
        stages = _stages(2, (1,))
        torch.manual_seed(0)
        model = gt.to_global(GPT(_cfg(2)).double(), stages[0], pp_plan(stages, 2))
        gt.Pipeline(model, microbatches=2, loss_fn=loss_fn).step(*_data(4))
        model.ln_f.weight.grad.fill_(float("inf"))
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        return True
    assert gt.launch(run, 2) == [True, True]


def test_only_scalars_span_placements():
    """Scalars alone meet on the union of their placements; a scalar Broadcast on ranks that include an op's is
    used where the op runs (its non-scalar inputs', or an in-place op's target's), moving nothing; anything else
    is an error naming the fix (a non-scalar, or a scalar that ranks outside the op would have to send)."""
    def run():
        p0, p1 = gt.placement("cpu", [0]), gt.placement("cpu", [1])
        a = gt.to_global(torch.tensor(2.0, dtype=torch.float64), p0, B)
        b = gt.to_global(torch.tensor(3.0, dtype=torch.float64), p1, B)
        v = gt.to_global(torch.ones(3, dtype=torch.float64), p1, B)
        s = torch.stack([a, b])
        assert s.placement == gt.placement("cpu", [0, 1]) and s.full_tensor().tolist() == [2.0, 3.0]
        with pytest.raises(ValueError, match="0-dim input laid out \\(P,\\).*to_global"):
            v * s.sum()               # Partial on the union: its reduction needs rank 0, which is outside the op
        u = s.sum().to_global(s.placement, B)
        with gt.comm_log() as log:
            w = v * u
            a.mul_(u)
        assert log.events == []
        assert w.placement == p1 and a.placement == p0
        assert (w.to_local().tolist(), a.to_local().tolist()) == (([5.0] * 3, []) if gt.rank() else ([], 10.0))
        with pytest.raises(ValueError, match="0-dim input .* on placement\\('cpu', \\[0\\]\\).*to_global"):
            v * a
        with pytest.raises(ValueError, match="different placements.*to_global.*scalars"):
            v + gt.to_global(torch.ones(3, dtype=torch.float64), p0, B)
        return True
    assert gt.launch(run, 2) == [True, True]


def _peak_saved_bytes(n_stages, kind, micro, batch):
    stages = _stages(n_stages, (1,))
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(n_stages)).double(), stages[0], pp_plan(stages, n_stages))
    pipe = gt.Pipeline(model, microbatches=micro, schedule=kind, loss_fn=loss_fn, measure_activations=True)
    pipe.step(*_data(batch))
    assert pipe.activations.live == 0  # everything saved was released by the backward
    return pipe.stage, pipe.activations.peak


@pytest.mark.parametrize("n_stages", [2, 4])
def test_1f1b_holds_stages_minus_stage_micro_batches_of_activations_gpipe_all(n_stages):
    """Measured in bytes (the tensors autograd saves, each storage once, weights excluded): with equal
    micro-batches, GPipe's peak per stage is m micro-batches' activations, 1F1B's exactly
    min(p - stage, m) of them (PipeDream-flush's memory claim)."""
    micro, batch = 8, 8
    gpipe = dict(gt.launch(_peak_saved_bytes, n_stages, args=(n_stages, "gpipe", micro, batch)))
    one_f_one_b = dict(gt.launch(_peak_saved_bytes, n_stages, args=(n_stages, "1f1b", micro, batch)))
    for stage in range(n_stages):
        one = gpipe[stage] // micro                  # one micro-batch's activations on this stage
        assert one > 0 and gpipe[stage] == micro * one
        assert one_f_one_b[stage] == min(n_stages - stage, micro) * one, (stage, one_f_one_b[stage], one)


def test_a_stage_of_one_rank_runs_its_blocks_on_plain_tensors(monkeypatch):
    """On a one-rank placement a GlobalTensor is its local tensor: a stage module there (no layout
    hints inside) runs on the plain local tensors, so its matmuls never reach the dispatcher; a
    stage of two ranks (PP x DP) dispatches them. Values equal one device either way (the tests above)."""
    import globaltensor.tensor as gtt
    seen = []
    run, step = gtt._run, gt.Pipeline.step
    stepping = threading.local()

    def spy(func, args, kwargs, cls):
        where = next((a.placement for a in args if isinstance(a, gt.GlobalTensor)), None)
        if where is not None and gt.rank() in where:  # ranks outside see a stage's ops in the first step
            seen.append((gt.world_size(), str(func) + (" in the step" if getattr(stepping, "on", False) else "")))
        return run(func, args, kwargs, cls)

    def spied_step(self, *args):
        stepping.on = True
        try:
            return step(self, *args)
        finally:
            stepping.on = False
    monkeypatch.setattr(gtt, "_run", spy)
    monkeypatch.setattr(gt.Pipeline, "step", spied_step)
    gt.launch(pipelined, 2, args=(2, 2, "1f1b", 2, 4, 1))
    # the blocks' linears (addmm) and attention, and the head (bias-free mm), which gathers the tied
    # weight onto the last stage: its gathered copy runs as a local tensor too
    assert not [f for n, f in seen if n == 2 and ("addmm" in f or "scaled_dot" in f or ".mm." in f)]
    # the loss is a stage of its own (plain there too), and the two micro-batches' gradients are summed
    # on the plain leaves: one GlobalTensor add_ in the step, where the tied weight's two gradients (the
    # embedding's, the head's sent back) meet; none per parameter and micro-batch
    assert not [f for n, f in seen if n == 2 and "nll_loss" in f]
    assert [f for n, f in seen if n == 2 and "add_.Tensor in the step" in f] == ["aten.add_.Tensor in the step"]
    seen.clear()
    gt.launch(pipelined, 4, args=(2, 2, "1f1b", 2, 4, 1, "none", (2,)))
    assert [f for n, f in seen if n == 4 and "addmm" in f]


def _replay(actions, stages, virtual, t_forward=1.0, t_backward=2.0):
    """Run a schedule's actions on an ideal machine (each chunk's forward t_forward / virtual, its backward
    t_backward / virtual, messages free): each rank in its own order, an action waiting for the previous
    virtual stage's forward or the next one's backward. Returns the largest idle fraction of a rank, or
    raises if the ranks' orders deadlock."""
    done, free, pos, busy = {}, [0.0] * stages, [0] * stages, [0.0] * stages
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while pos[s] < len(actions[s]):
                act, i, c = actions[s][pos[s]]
                vs = c * stages + s
                if act == "F":
                    deps = [("F", i, vs - 1)] if vs > 0 else []
                else:
                    deps = [("B", i, vs + 1)] if vs < stages * virtual - 1 else [("F", i, vs)]
                if any(d not in done for d in deps):
                    break
                dur = (t_forward if act == "F" else t_backward) / virtual
                done[(act, i, vs)] = free[s] = max([free[s]] + [done[d] for d in deps]) + dur
                busy[s] += dur
                pos[s] += 1
                progress = True
    assert pos == [len(a) for a in actions], f"deadlock at {pos}"
    return max(1 - b / max(free) for b in busy)


@pytest.mark.parametrize("kind,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [4, 8, 12, 16])
def test_schedules_reach_their_textbook_bubble(kind, virtual, stages, micro):
    """On an ideal machine each schedule is deadlock-free and idles exactly its textbook share:
    (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) interleaved (Megatron's
    (p - 1) / (v m) of the ideal time)."""
    if kind == "interleaved" and micro % stages:
        with pytest.raises(ValueError, match="microbatches"):
            schedule_actions(kind, stages, micro, virtual)
        return
    idle = _replay(schedule_actions(kind, stages, micro, virtual), stages, virtual)
    assert idle == pytest.approx((stages - 1) / (virtual * micro + stages - 1), abs=1e-12)


def _all_reduce(numel: int, n: int = 2) -> int:
    """Bytes one rank receives in an all-reduce of `numel` fp64 values over n ranks (even pieces)."""
    return 2 * (n - 1) * numel * F64 // n


def pp_dp_tp_collectives(stage: int, n_layer: int, virtual: int, micro: int, batch: int) -> Counter:
    """What one rank of PP=2 x DP=2 x TP=2 (`tp_plan` in each stage, `dp_batch` data) must move in one
    training step (`Pipeline.step` and AdamW's), as {(kind, where, bytes): count}, where is "tensor" or
    "data" (this rank's groups in its stage's mesh) or "stages" (a point-to-point to the other stage).

    Derived, not recorded: the stage's own blocks under DP x TP alone (test_gpt_comm.py's Megatron
    count, per micro-batch: forward all-reduces of the embedding and each row-parallel output, backward
    of each column-parallel region's input gradient and the head's; the vocab-split log_softmax's row
    max and sum forward and row sum backward; the data axis's target count; one flat bucket of the
    stage's gradient shards per step), plus, at the lower bound, each stage boundary's activation
    (forward) and gradient (backward) per micro-batch, received by each rank of the receiving stage
    (its own rows, whole on the tensor axis: TP needs the residual stream on both tensor ranks), each
    send a zero-byte event of the sender's; and the tied embedding/head weight: its tensor shard sent
    once per step to the last stage, and the head's gradient, summed over the micro-batches, sent back
    once (each first-stage rank receives its tensor shard of it, a Partial across the placements that
    joins the embedding's gradient in the first stage's bucket)."""
    d = t = 2
    tokens = batch // micro // d * T                       # per data rank and micro-batch
    act = tokens * D * F64                                 # a boundary activation (or its gradient), one rank's
    wshard = VOCAB * D // t                                # the tied weight's tensor shard (elements)
    blocks = n_layer // 2                                  # blocks on each stage (interleaved: two chunks)
    last = 2 * virtual - 1
    out: Counter = Counter()
    # the stage's blocks under DP x TP: Megatron's collectives (test_gpt_comm.megatron), per micro-batch
    out[("all_reduce", "tensor", _all_reduce(tokens * D))] += micro * 4 * blocks  # 2 forward + 2 backward
    params = blocks * ((12 * D * D + 7 * D) // t + 6 * D)  # column/row-parallel shards, norms and row biases whole
    if stage == 0:
        out[("all_reduce", "tensor", _all_reduce(tokens * D))] += micro          # vocab-parallel embedding
        params += wshard + T * D                                                  # wte (its shard), wpe
    else:
        out[("all_reduce", "tensor", _all_reduce(tokens * D))] += micro          # the head's input gradient
        out[("all_reduce", "tensor", _all_reduce(tokens))] += micro * 3          # log_softmax: max, sum; backward
        out[("all_reduce", "data", _all_reduce(1))] += micro                     # the mean's target count
        params += 2 * D                                                           # ln_f
    out[("all_reduce", "data", _all_reduce(params))] += 1                         # the step's gradient bucket
    # the stage boundaries, per micro-batch: each chunk receives its input unless it is the first virtual
    # stage, and its output's gradient unless it is the last; it sends the same messages the other way
    chunks = [c * 2 + stage for c in range(virtual)]
    crossings = sum(vs > 0 for vs in chunks) + sum(vs < last for vs in chunks)
    out[("send_recv", "stages", act)] += micro * crossings
    out[("send_recv", "stages", 0)] += micro * crossings
    # the tied weight, once per step: its shard to the last stage, the head's summed gradient back
    out[("send_recv", "stages", wshard * F64 if stage == 1 else 0)] += 1
    out[("send_recv", "stages", wshard * F64 if stage == 0 else 0)] += 1
    return out


def _where(e, rank: int, stage_mesh_of: dict) -> str:
    """A collective's group named from this rank: its tensor or data peers, or a message across stages."""
    mine = stage_mesh_of[rank]
    if any(r not in mine.flat_ranks for r in e.group):
        assert e.kind == "send_recv", e
        return "stages"
    axis = [a for a in range(2) if tuple(e.group) in mine.axis_groups(a)]
    assert len(axis) == 1, e
    return ("data", "tensor")[axis[0]]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_x_data_x_tensor_on_eight_ranks(kind):
    """PP=2 x DP=2 x TP=2: each stage a 2x2 data x tensor mesh with Megatron TP inside; AdamW steps equal
    one device, and the last step's collectives (the pipeline's and the optimizer's) on every rank are
    exactly `pp_dp_tp_collectives`. 4 steps: 20 took 24 s of CPU against 10 s for the three schedules
    (measured on the 2-core CI machine); the 20-step claim is test_gpt_pipeline_trains_as_one_device's.
    Batch 8 (2 rows per data rank and micro-batch): the vocab-parallel embedding's backward runs in the
    named scope though its input (the indices) needs no gradient (module.py: until the backward ends), so
    its weight's gradient is left Partial over the data axis for the step's bucket; out of the scope the
    dispatcher chose, for so few rows, to split it on the hidden dim (the output gradient exchanged, the
    indices all-gathered: cheaper than reducing the Partial), leaving wte's gradient (S(1), S(1)), which
    AdamW converted back to the parameter's (B, S(0)) at each of its three reads: 6400 B per first-stage
    rank and step where the bucket's share is 2048.

    The tied weight's gradient: the head's, summed over the micro-batches, lands on the first stage still
    Partial over the data axis (zero.py `_kept_partial`: the parameter is Broadcast there, and the step's
    bucket reduces it anyway), and meets the embedding's, (P, B), in (P, S(0)) (`_sum_layout`: Partial
    where either is, else the stored split; the embedding's sliced for free), which joins the bucket.
    Before, the head's was reduce-scattered and sent reduced to every first-stage rank (B, S(0)), then
    all-gathered over the tensor axis to add into the (P, B) one in place, whose sum was all-reduced on
    its own, out of the bucket: per step 1024 B and one collective more on each last-stage rank, 1024 B
    (an all-gather; the sum's all-reduce the bytes of its bucket share) and two collectives more on each
    first-stage rank. The head's Partial crosses the stages as it is, each last-stage rank's share to the
    first-stage rank at its mesh coordinate (boxing/exchange.py `relocate`): before the planner had that
    edge, it was reduce-scattered over the last stage's data axis first and the sums sent to the
    data-coordinate-0 ranks (the same bytes in all, one collective more, 1024 B more on each last-stage
    rank)."""
    virtual = 2 if kind == "interleaved" else 1
    n_layer, micro, batch, steps = 2 * virtual, 2, 8, 4
    want_losses, want_state = reference(n_layer, batch, steps)
    results = gt.launch(pipelined, 8, args=(2, n_layer, kind, micro, batch, steps, "tp", (2, 2), virtual,
                                                 False, True))
    _check_values(results, want_losses, want_state)
    stages = _stages(2, (2, 2))
    stage_mesh_of = {r: p for p in stages for r in p.flat_ranks}
    for rank, (*_, events, _peak, stage, _left) in enumerate(results):
        got = Counter((e.kind, _where(e, rank, stage_mesh_of), e.recv_bytes) for e in events[-1])
        want = pp_dp_tp_collectives(stage, n_layer, virtual, micro, batch)
        assert got == want, (rank, stage, sorted((got - want).items()), sorted((want - got).items()))


def _gather(numel: int, n: int = 2) -> int:
    """Bytes one rank receives in an all-gather (or reduce-scatter) of `numel` fp64 values over n ranks."""
    return (n - 1) * numel * F64 // n


def pp_zero_collectives(stage: int, n_layer: int, virtual: int, micro: int, batch: int, zero3: bool) -> Counter:
    """What one rank of PP=2 x ZeRO (2 ranks per stage, `zero_plan`: each block a group, the rest the
    root's) must move in one training step, as `pp_dp_tp_collectives` counts it ("data": the stage's
    two ranks). Each group of the stage (its blocks; of the root's parameters those on the stage:
    wte and wpe on the first, ln_f on the last) is gathered and its gradients reduce-scattered: ZeRO-2
    once per step; ZeRO-3 per micro-batch, gathered again for the backward (resharded after the
    forward: its memory bound), reduced per micro-batch (FSDP2's default). The last stage all-reduces
    the mean's target count per micro-batch. The tied weight: its shard sent to the last stage once per
    step and gathered there once (the head keeps it for the step, gathered as the first stage's ZeRO group
    uses it: pp_plan's reshard_after_forward=False),
    the head's gradient, summed over the micro-batches, reduce-scattered there and each shard sent back
    (ZeRO keeps the first stage's gradient split: the shard is what it needs). The boundaries as in
    `pp_dp_tp_collectives`."""
    tokens = batch // micro // 2 * T
    block = 12 * D * D + 13 * D                            # a block's parameters (elements)
    groups = [block] * (n_layer // 2) + [VOCAB * D + T * D if stage == 0 else 2 * D]
    out: Counter = Counter()
    for numel in groups:
        out[("all_gather", "data", _gather(numel))] += 2 * micro if zero3 else 1
        out[("reduce_scatter", "data", _gather(numel))] += micro if zero3 else 1
    wshard = VOCAB * D // 2 * F64
    if stage == 1:
        out[("all_reduce", "data", _all_reduce(1))] += micro   # the mean's target count
        out[("all_gather", "data", _gather(VOCAB * D))] += 1   # the head's weight, once per step
        out[("reduce_scatter", "data", _gather(VOCAB * D))] += 1  # its gradient, summed over the micro-batches
    chunks = [c * 2 + stage for c in range(virtual)]
    crossings = sum(vs > 0 for vs in chunks) + sum(vs < 2 * virtual - 1 for vs in chunks)
    out[("send_recv", "stages", tokens * D * F64)] += micro * crossings
    out[("send_recv", "stages", 0)] += micro * crossings
    out[("send_recv", "stages", wshard if stage == 1 else 0)] += 1   # the tied weight's shard, forward
    out[("send_recv", "stages", wshard if stage == 0 else 0)] += 1   # the head's gradient's, back
    return out


@pytest.mark.parametrize("inner,kind", [("zero", "1f1b"), ("zero2", "1f1b"), ("zero2", "interleaved"),
                                        ("zero", "interleaved")])
def test_pipeline_x_zero(inner, kind):
    """PP=2 x ZeRO-3 (and ZeRO-2) on 2 ranks per stage; interleaved too (the fiber stops before a chunk's
    first module gathers: its hooks belong to the chunk; and a resumed fiber puts its own open calls'
    gathered parameters back in the slots, which other micro-batches' forwards changed meanwhile: the
    root's ZeRO-3 group spans the chunks). The last step's collectives on every rank are exactly
    `pp_zero_collectives`, but for the form the head's weight arrives in: the boxing planner moves it from
    (first stage, S(0)) to (last stage, B) in one exchange, each last-stage rank receiving the whole
    weight from the first stage's two ranks, rather than its shard across and an all-gather inside the
    stage: the same bytes per rank (which is what the planner minimises), twice those across the stages
    (it has no path that moves first and converts on the target placement, and would not prefer it on
    bytes alone). ZeRO-2 interleaved once moved more: the micro-batches' backwards run on their own
    fibers (threads), the named scope the cost model reads is per thread, and a call kept for the step
    entered it once, on the first backward's thread; micro-batch 1's backward, resumed while micro-batch
    0's was stopped inside the root's, then decided the embedding's gradient out of the scope and reduced
    it early (an all-to-all and an all-gather, 1152 B on each first-stage rank). Each thread now enters
    the call's scope for itself (`_Call.enter_scope`)."""
    virtual = 2 if kind == "interleaved" else 1
    n_layer, micro, batch, steps = 2 * virtual, 2, 8, 4
    want_losses, want_state = reference(n_layer, batch, steps)
    results = gt.launch(pipelined, 4, args=(2, n_layer, kind, micro, batch, steps, inner, (2,), virtual, False, True))
    _check_values(results, want_losses, want_state)
    stage_mesh_of = {r: p for p in _stages(2, (2,)) for r in p.flat_ranks}
    for rank, (*_, events, _peak, stage, _left) in enumerate(results):
        got = Counter((e.kind, "stages" if any(r not in stage_mesh_of[rank].flat_ranks for r in e.group) else "data",
                       e.recv_bytes) for e in events[-1])
        want = pp_zero_collectives(stage, n_layer, virtual, micro, batch, inner == "zero")
        if stage == 1:  # the head's weight arrives whole from the first stage (one exchange), not as its
            wshard = VOCAB * D // 2 * F64  # shard sent across and gathered in the stage: bytes per rank equal
            want[("send_recv", "stages", wshard)] -= 1
            want[("all_gather", "data", _gather(VOCAB * D))] -= 1
            want[("send_recv", "stages", 2 * wshard)] += 1
        assert got == want, (rank, stage, sorted((got - want).items()), sorted((want - got).items()))


@settings(deadline=None, max_examples=max(4, settings.default.max_examples // 4))  # each example trains 2-3 ranks
@given(n_stages=st.integers(2, 3), extra_layers=st.integers(0, 2), micro=st.integers(1, 5),
       batch=st.integers(3, 7), kind=st.sampled_from(["gpipe", "1f1b", "interleaved"]), replay=st.booleans())
def test_pipeline_hypothesis_splits_microbatches_schedules(n_stages, extra_layers, micro, batch, kind, replay):
    """Uneven layer counts per stage (earlier stages take the extra blocks), micro-batch counts that do
    not divide the batch (tensor_split's sizes, differing by one; each micro-batch's loss is weighted
    by its share of the batch, so the step equals one pass over the whole batch), every schedule
    (interleaved: two chunks per stage, micro-batches a multiple of the stages). Three steps: the third posts
    its receives ahead (`Pipeline(post_receives=)`), micro-batches of two sizes among them, and every stage
    but the last leaves each micro-batch's forward after its last send (`early_exit`). With `replay`, five
    steps of the untied model: the last two replay each rank's recorded part (`Pipeline(replay=True)`)."""
    micro = min(micro, batch)
    virtual = 1
    if kind == "interleaved":
        virtual, micro = 2, max(n_stages, micro - micro % n_stages)
    n_layer = n_stages * virtual + extra_layers
    steps = 5 if replay else 3
    want_losses, want_state = reference(n_layer, batch, steps, tied_head=not replay)
    results = gt.launch(pipelined, n_stages, args=(n_stages, n_layer, kind, micro, batch, steps, "none", (1,), virtual,
                                                   False, False, not replay, replay))
    _check_values(results, want_losses, want_state)
    assert [r[-1] for r in results] == ([0] * n_stages if replay else [micro] * (n_stages - 1) + [0])


def test_schedules_are_data():
    acts = [[a[:2] for a in row] for row in schedule_actions("1f1b", 3, 4)]
    assert acts[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert acts[2] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert schedule_actions("gpipe", 2, 2) == [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]] * 2
    with pytest.raises(ValueError, match="schedule"):
        schedule_actions("zigzag", 2, 2)


def _failing(kind, schedule="1f1b"):
    stages = _stages(2, (1,))
    torch.manual_seed(0)
    virtual = 2 if schedule == "interleaved" else 1
    model = gt.to_global(GPT(_cfg(2 * virtual)).double(), stages[0], pp_plan(stages, 2 * virtual, virtual=virtual))

    def bad_loss(out, tgt):
        if gt.rank() == 1:
            raise RuntimeError("stage 1 broke")
        return loss_fn(out, tgt)
    micro = 2 if kind == "raise" or gt.rank() == 0 else 4    # "mismatch": the ranks disagree on the schedule
    pipe = gt.Pipeline(model, microbatches=micro, schedule=schedule, loss_fn=bad_loss if kind == "raise" else loss_fn)
    return pipe.step(*_data(4))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_failing_stage_and_a_schedule_mismatch_end_with_an_error(schedule):
    """Interleaved: the failure happens inside a micro-batch's fiber, which hands it to its rank; the
    other micro-batches' fibers, stopped mid-way, are unwound (no thread left waiting)."""
    before = {t for t in threading.enumerate() if t.name.startswith("gt-pipeline")}
    with pytest.raises(Exception, match="stage 1 broke"):
        gt.launch(_failing, 2, args=("raise", schedule), timeout=20)
    with pytest.raises(Exception, match="send_recv|never completed|mismatch"):
        gt.launch(_failing, 2, args=("mismatch", schedule), timeout=20)
    time.sleep(0.2)
    assert {t for t in threading.enumerate() if t.name.startswith("gt-pipeline")} <= before


def test_fibers_reuse_their_worker_threads():
    """A thread's first autograd call costs torch about a millisecond of setup: an interleaved step's
    fibers run on pooled workers, so the next step's fibers (a cancelled one's included) run on the
    same threads, each named after its fiber only while inside it."""
    from globaltensor.runtime.fiber import Fiber, cross

    def body():
        cross(entering=False)
        cross(entering=True)  # left a chunk, entering another: stops here
        return threading.current_thread()

    first = Fiber(body, name="gt-test-fiber")
    first.resume()
    assert not first.done and "gt-test-fiber" in {t.name for t in threading.enumerate()}
    first.resume()
    assert first.done
    stopped = Fiber(body, name="gt-test-fiber")
    stopped.resume()
    stopped.cancel()
    again = Fiber(body, name="gt-test-fiber")
    again.resume()
    again.resume()
    assert again.result is first.result
    assert "gt-test-fiber" not in {t.name for t in threading.enumerate()}


def _dropout_pipeline(dropout: float, kind: str):
    stages = _stages(2, (1,))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=4, n_head=4, n_embd=D, dropout=dropout)
    model = gt.to_global(GPT(cfg).double(), stages[0], pp_plan(stages, 4, virtual=2 if kind == "interleaved" else 1))
    pipe = gt.Pipeline(model, microbatches=2, schedule=kind, loss_fn=loss_fn)
    x, t = _data(4)
    for _ in range(3):
        pipe.step(x, t)


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_a_stage_that_draws_random_numbers_is_said_once_not_silently_unlike_one_device(kind):
    """Dropout in a stage: the ranks outside it draw none of its numbers, so the later stages' masks differ from
    one device's (the one op a pipeline does not compute as one device). The first step says so, once per stage
    drawing on each rank; without dropout, nothing is said."""
    with pytest.warns(UserWarning, match=r"drew random numbers in its forward on rank \d \(dropout\?\)") as seen:
        gt.launch(_dropout_pipeline, 2, args=(0.1, kind))
    said = [str(w.message) for w in seen if "drew random numbers" in str(w.message)]
    # the stages that draw: the embeddings' dropout on rank 0 (wte and wpe draw nothing: it is the glue's), each
    # block (attention and residual dropout), on its rank; once each, in the first step only
    assert sorted((m.split("module ")[1].split(" ")[0], m.split("rank ")[1][0]) for m in said) == \
        [("Block", "0"), ("Block", "0"), ("Block", "1"), ("Block", "1")]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gt.launch(_dropout_pipeline, 2, args=(0.0, kind))


def test_an_interleaved_fiber_stops_where_a_stage_is_entered_before_its_pre_hooks():
    """A stage module with no forward pre-hook stops a fiber at the start of its call (no hook of ours: torch's fast
    call path); one registered later (here after a step) makes the stop a hook again at the next step, run
    before the user's, which thus runs in the chunk the module belongs to, not in the one the fiber leaves."""
    def body():
        stages = _stages(2, (1,))
        torch.manual_seed(0)
        model = gt.to_global(GPT(_cfg(4)).double(), stages[0], pp_plan(stages, 4, virtual=2))
        pipe = gt.Pipeline(model, microbatches=2, schedule="interleaved", loss_fn=loss_fn)
        x, t = _data(4)
        losses = [pipe.step(x, t)]
        block = model.blocks[2]  # chunk 2: rank 0's second
        forward = block.__dict__["forward"]
        inline = forward.enters_inline and "_gt_stage_hooks" not in block.__dict__
        now, seen = [None], []
        real = pipe._chunk

        def chunk(fibers, act, i, c, run):
            now[0] = (act, i, c)
            return real(fibers, act, i, c, run)
        pipe._chunk = chunk
        block.register_forward_pre_hook(lambda mod, args: seen.append(now[0]))
        losses.append(pipe.step(x, t))
        opt_free = [loss.full_tensor().item() for loss in losses] if gt.rank() in losses[0].placement else None
        return inline, forward.enters_inline, "_gt_stage_hooks" in block.__dict__, seen, opt_free

    r0, r1 = gt.launch(body, 2)
    assert r0[:3] == (True, False, True) and r1[:3] == (True, False, True)
    assert r0[3] == [("F", 0, 1), ("F", 1, 1)]  # rank 0: inside its second chunk
    assert r1[3] == [("F", 0, 0), ("F", 1, 0)]  # rank 1 calls it outside, on its way out of its first chunk
    torch.manual_seed(0)
    model = GPT(_cfg(4)).double()
    x, t = _data(4)
    want = loss_fn(model(x), t).item()
    np.testing.assert_allclose(r1[4], [want, want], rtol=0, atol=1e-10)  # no optimizer step between


def test_a_fiber_runs_in_its_creators_named_scope_and_leaves_none_on_its_thread():
    """The named scope (ops/scope.py) is per thread: a fiber starts in its creator's depth, and a fiber
    cancelled inside a named module (a failed step) leaves no depth on its pooled worker for the next one."""
    from globaltensor.ops.scope import enter_named, in_named, leave_named
    from globaltensor.runtime.fiber import Fiber, cross

    def inside():
        enter_named()
        cross(entering=False)
        cross(entering=True)  # stops here, inside the scope
        leave_named()

    stopped = Fiber(inside, name="gt-test-fiber")
    stopped.resume()
    stopped.cancel()
    assert not in_named()
    plain = Fiber(in_named, name="gt-test-fiber")
    plain.resume()
    assert plain.result is False          # same worker thread, no depth left over
    enter_named()
    try:
        named = Fiber(in_named, name="gt-test-fiber")
    finally:
        leave_named()
    named.resume()
    assert named.result is True           # created inside a named scope: runs in it
    assert not in_named()


def test_a_named_module_whose_input_needs_no_gradient_runs_its_backward_named():
    """An embedding under a ModuleLayout (its input, the indices, needs no gradient, so no mark ends its
    backward there): its backward runs in the named scope, which the backward's end leaves, also when it
    ends on another thread than the one that entered (autograd's final callbacks run on the thread that
    called backward(); a CUDA backward's nodes on the device's thread)."""
    from globaltensor.ops.scope import enter_named_here, in_named

    def run():
        emb = gt.to_global(torch.nn.Embedding(8, 4).double(), gt.placement("cpu", [0, 1]),
                           {"weight": gt.split(0), "": gt.ModuleLayout(output=B)})
        seen = []
        emb.weight.register_hook(lambda g: seen.append(in_named()))
        idx = gt.to_global(torch.tensor([[1, 5, 2]]), gt.placement("cpu", [0, 1]), B)
        out = emb(idx)
        assert not in_named()
        out.sum().backward()
        leave = enter_named_here()
        other = threading.Thread(target=leave)
        other.start()
        other.join()
        return seen, in_named()
    assert gt.launch(run, 2) == [([True], False)] * 2


def test_pipeline_bad_input():
    def run():
        stages = _stages(2, (1,))
        model = gt.to_global(GPT(_cfg(2)).double(), stages[0], pp_plan(stages, 2))
        with pytest.raises(ValueError, match="microbatches"):
            gt.Pipeline(model, microbatches=0, loss_fn=loss_fn)
        with pytest.raises(ValueError, match="schedule"):
            gt.Pipeline(model, microbatches=2, schedule="zigzag", loss_fn=loss_fn)
        with pytest.raises(TypeError, match="loss_fn"):  # loss_fn is optional (the model's own loss), not any value
            gt.Pipeline(model, microbatches=2, loss_fn="cross_entropy")
        with pytest.raises(ValueError, match="virtual"):  # one chunk per stage: nothing to interleave
            gt.Pipeline(model, microbatches=2, schedule="interleaved", loss_fn=loss_fn)
        with pytest.raises(ValueError, match="virtual"):
            pp_plan(stages, 2, virtual=2)                   # 2 blocks cannot make 4 chunks
        chunked = gt.to_global(GPT(_cfg(4)).double(), stages[0], pp_plan(stages, 4, virtual=2))
        with pytest.raises(ValueError, match="microbatches"):
            gt.Pipeline(chunked, microbatches=3, schedule="interleaved", loss_fn=loss_fn)
        with pytest.raises(ValueError, match="interleaved"):  # 1F1B would deadlock on a looping plan
            gt.Pipeline(chunked, microbatches=2, schedule="1f1b", loss_fn=loss_fn)
        pipe = gt.Pipeline(model, microbatches=2)  # no loss_fn: the model's own loss, which the GPT's logits are not
        with pytest.raises(ValueError, match=r"shape \[2, 8, 32\], not a scalar.*gt.Pipeline\(loss_fn=\)"):
            pipe.step(_data(4)[0])
    gt.launch(run, 4)


@pytest.mark.gloo
@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_pipeline_x_data_under_gloo(kind):
    """PP=2 x DP=2 on 4 real processes (interleaved: the micro-batches' fibers share the process group)."""
    virtual = 2 if kind == "interleaved" else 1
    want_losses, want_state = reference(2 * virtual, 8, 3)
    results = gt.launch(pipelined, 4, args=(2, 2 * virtual, kind, 2, 8, 3, "none", (2,), virtual), backend="gloo",
                        timeout=120)
    _check_values(results, want_losses, want_state)
    assert [r[-1] for r in results] == [2, 2, 0, 0]  # the third step: the first stage left both forwards


def _torch_transformer(steps, stages=None):
    """torch's test Transformer (tests/thirdparty), unchanged: AdamW steps on its logits' cross-entropy (in
    fp64: its forward casts the logits to fp32, the loss need not). `stages`: two placements, the plan puts
    the embeddings and layer 0 on the first, layer 1 and the final norm on the second, and the output
    projection, whose weight is the token embedding's (tied), used on the second (as pp_plan's head); the
    model runs as a 1F1B pipeline of 2 micro-batches. Returns (losses, state, held, last step's events)."""
    from thirdparty.torch_test_transformer import ModelArgs, Transformer
    vocab = 16

    def loss(out, tgt):
        return F.cross_entropy(out.double().reshape(-1, vocab), tgt.reshape(-1))
    g = torch.Generator().manual_seed(4)
    x, t = torch.randint(0, vocab, (8, T), generator=g), torch.randint(0, vocab, (8, T), generator=g)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=vocab, max_seq_len=T, dim=D, n_heads=4,
                                  dropout_p=0.0)).double()
    if stages is not None:
        first, last = (gt.Layout(p, (B,)) for p in stages)
        model = gt.to_global(model, stages[0], {
            "tok_embeddings.*": first, "pos_embeddings.*": first, "layers.0.*": first,
            "layers.1.*": last, "norm.*": last, "output": gt.ModuleLayout(params=last, reshard_after_forward=False)})
        pipe = gt.Pipeline(model, microbatches=2, schedule="1f1b", loss_fn=loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, events = [], []
    for _ in range(steps):
        with gt.comm_log() as log:
            if stages is None:
                out = loss(model(x), t)
                out.backward()
            else:
                out = pipe.step(x, t)
        opt.step()
        opt.zero_grad()
        if stages is None:
            losses.append(out.item())
        elif gt.rank() in out.placement:
            losses.append(out.full_tensor().item())
        events = log.events
    if stages is None:
        return losses, {k: v.detach() for k, v in model.state_dict().items()}
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    held = {k: gt.rank() in v.placement for k, v in model.state_dict().items()}
    return losses, state, held, events


def test_torch_test_transformer_becomes_a_pipeline_by_its_plan_alone():
    """A model nobody here wrote, unchanged, split over 2 stages by its plan (placements per parameter
    pattern, the tied output projection used on the last stage): 3 AdamW steps equal one device (fp64,
    1e-10), and the step's messages are the lower bound: per micro-batch the activation [4, 8, 16] and its
    gradient, once per step the tied weight [16, 16] to the last stage and its summed gradient back."""
    steps = 3
    want_losses, want_state = _torch_transformer(steps)
    results = gt.launch(_torch_transformer, 2, args=(steps, [gt.placement("cpu", [0]), gt.placement("cpu", [1])]))
    _check_values(results, want_losses, want_state)
    act, weight = 4 * T * D * F64, 16 * D * F64
    for stage, (*_, events) in enumerate(results):
        assert {e.kind for e in events} == {"send_recv"}
        got = sorted(e.recv_bytes for e in events)
        want = sorted([act] * 2 + [weight] + [0] * 3)   # received: 2 gradients (first) or activations (last);
        assert got == want, (stage, got, want)          # the tied weight's gradient or the weight; 3 sends


def test_timeline_svg_draws_one_bar_per_action_in_its_ranks_row():
    """A synthetic timeline of two ranks: one bar per action in the rank's row, placed and sized by its
    times on one scale, forward light and backward dark, named (chunk after a dot), and the waiting inside
    an action a hatched bar of the wait's length over the action's start."""
    import xml.etree.ElementTree as ET
    from globaltensor.parallel.pipeline import timeline_svg
    timelines = [[("F", 0, 0, 0.0, 1.0, 0.0), ("B", 0, 0, 2.0, 4.0, 0.5)],
                 [("F", 0, 1, 1.0, 2.0, 0.25), ("B", 1, 0, 2.0, 3.0, 0.0)]]
    ns = {"s": "http://www.w3.org/2000/svg"}
    root = ET.fromstring(timeline_svg(timelines, width=400))
    scale = 400 / 4.0                                               # the latest end spans the width
    assert [t.text for t in root.findall("s:text", ns) if t.text.startswith("rank")] == ["rank 0", "rank 1"]
    bars = [r for r in root.findall("s:rect", ns) if r.find("s:title", ns) is not None]
    waits = root.findall("s:rect[@class='wait']", ns)
    assert len(bars) == 4 and len(waits) == 2
    want_bars = [(5 + 28 * r, 55 + s * scale, (e - s) * scale, "#9ecae1" if act == "F" else "#3182bd",
                  f"{act}{i}" + (f".{c}" if c else "")) for r, tl in enumerate(timelines) for act, i, c, s, e, _ in tl]
    got_bars = [(float(b.get("y")), float(b.get("x")), float(b.get("width")), b.get("fill"),
                 b.find("s:title", ns).text.split(":")[0]) for b in bars]
    assert got_bars == want_bars
    want_waits = [(5 + 28 * r, 55 + s * scale, w * scale) for r, tl in enumerate(timelines)
                  for *_, s, e, w in tl if w > 0]
    assert [(float(w.get("y")), float(w.get("x")), float(w.get("width"))) for w in waits] == want_waits


def test_bubble_is_the_idle_share_of_the_step(monkeypatch):
    """`Pipeline.bubble` = (waiting inside the actions + the step's time outside them) / the step's time.
    On a fake clock (the pipeline's reads of it: the step's start, each action's start and end, the
    step's end), one stage (nothing to wait for), GPipe of 2 micro-batches: actions at [1, 3], [3, 4],
    [6, 8], [8, 9] of a step from 0 to 10: busy 6 of 10, bubble 0.4. Then a real 2-stage run: each rank's
    timeline is its schedule's actions in order, times increasing, waits within them, bubble in [0, 1]."""
    import types
    import globaltensor.parallel.pipeline as pipeline
    ticks = iter([100.0, 101.0, 103.0, 103.0, 104.0, 106.0, 108.0, 108.0, 109.0, 110.0])

    def one_stage():
        model = gt.to_global(GPT(_cfg(1)).double(), gt.placement("cpu", [0]))
        pipe = gt.Pipeline(model, microbatches=2, schedule="gpipe", loss_fn=loss_fn)
        monkeypatch.setattr(pipeline, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
        try:
            pipe.step(*_data(4))
        finally:
            monkeypatch.undo()
        return pipe.timeline, pipe.bubble
    [(timeline, bubble)] = gt.launch(one_stage, 1)
    assert [(a, i, s, e, w) for a, i, _, s, e, w in timeline] == [
        ("F", 0, 1.0, 3.0, 0.0), ("F", 1, 3.0, 4.0, 0.0), ("B", 0, 6.0, 8.0, 0.0), ("B", 1, 8.0, 9.0, 0.0)]
    assert bubble == pytest.approx(0.4, abs=1e-12)

    def two_stages():
        stages = _stages(2, (1,))
        model = gt.to_global(GPT(_cfg(2)).double(), stages[0], pp_plan(stages, 2))
        pipe = gt.Pipeline(model, microbatches=4, schedule="1f1b", loss_fn=loss_fn)
        pipe.step(*_data(8))
        return pipe.stage, pipe.actions, pipe.timeline, pipe.bubble
    for stage, actions, timeline, bubble in gt.launch(two_stages, 2):
        assert [t[:3] for t in timeline] == actions[stage]
        ends = [0.0] + [x for *_, s, e, _ in timeline for x in (s, e)]
        assert ends == sorted(ends)
        assert all(0 <= w <= e - s for *_, s, e, w in timeline)
        assert 0 <= bubble <= 1


def test_the_tied_head_on_a_one_rank_stage_gathers_once_per_step(monkeypatch):
    """The head's weight (the embedding's, kept gathered for the step) is gathered once per step on the last stage,
    its micro-batches' gradients summed on a plain leaf and handed back through the gather once: one `_Gather`
    forward per step on both ranks, one backward on the last, no backward mark (`_Regather`) per micro-batch there;
    values as one device."""
    from globaltensor.parallel import zero
    from globaltensor.runtime import context
    counts: dict = {}

    def counting(cls, name):
        real = getattr(cls, name)

        def counted(*args, **kwargs):
            key = (context.current().rank, cls.__name__, name)
            counts[key] = counts.get(key, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(cls, name, staticmethod(counted))
    for cls in (zero._Gather, zero._Regather):
        counting(cls, "forward")
        counting(cls, "backward")
    steps, micro = 3, 4
    want_losses, want_state = reference(4, 8, steps)
    results = gt.launch(pipelined, 2, args=(2, 4, "1f1b", micro, 8, steps))
    _check_values(results, want_losses, want_state)
    for rank in (0, 1):  # the first stage moves the weight (its gather's sending side), the last takes it
        assert counts.get((rank, "_Gather", "forward")) == steps, counts
    assert counts.get((1, "_Gather", "backward")) == steps, counts
    assert counts.get((1, "_Regather", "forward"), 0) == 0, counts
