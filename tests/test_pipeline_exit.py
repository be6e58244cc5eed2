"""A rank leaves a micro-batch's forward once the rest of it is on other ranks (`early_exit`).

Leaving changes what a rank runs, never what any rank computes: the same values (bit for bit), the same
messages and bytes as the forward run whole, every parameter's gradient given on every rank; the rank
stays until its last message (the tied weight's move to the last stage keeps the first stage's rank
until the head); a program that comes to the learnt call changed runs on and is learnt again.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

import globaltensor as gt
from globaltensor.models.gpt import GPT, dp_batch, pp_plan, tp_plan, zero_plan
from test_pipeline import _cfg, _data, _stages, loss_fn, reference

B = gt.broadcast


def _trained(n_stages, kind, steps, leave, micro=4, virtual=1, stage_mesh=(1,), inner=None, model_cls=GPT,
             program=None):
    """Per step (loss on the last stage or None, forwards left, comm log), then the final state and each
    parameter's gradient presence of the last step (before the optimizer's step)."""
    stages = _stages(n_stages, stage_mesh)
    n_layer = n_stages * virtual
    torch.manual_seed(0)
    model = gt.to_global(model_cls(_cfg(n_layer)).double(), stages[0],
                         pp_plan(stages, n_layer, inner() if inner else None, virtual=virtual))
    nd = len(stage_mesh)
    data_sbp = dp_batch(0, nd) if stage_mesh[0] > 1 else (B,) * nd
    pipe = gt.Pipeline(model, microbatches=micro, schedule=kind, loss_fn=loss_fn, input_sbp=data_sbp,
                       leave_early=leave)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = _data(8)
    steps_out, grads = [], None
    for s in range(steps):
        if program is not None:
            program(model, s)
        with gt.comm_log() as log:
            loss = pipe.step(x, t)
        grads = {k: p.grad is not None for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        steps_out.append((loss.full_tensor().item() if gt.rank() in loss.placement else None, pipe.left_forwards,
                          [(e.kind, e.group, e.recv_bytes) for e in log.events]))
    state = {k: v._local.clone() for k, v in model.state_dict().items()}
    return steps_out, state, grads, pipe.stage, len(pipe.stages)


def _both(ranks: int, n_stages: int, kind: str, steps: int, **kwargs) -> tuple[list, list]:
    """The same training with and without leaving, each rank's `_trained`."""
    return tuple(gt.launch(partial(_trained, **kwargs), ranks, args=(n_stages, kind, steps, leave))
                 for leave in (True, False))


def _same(on: list, off: list) -> None:
    """Rank by rank: the same losses, messages and bytes per step, bit-equal shards, the same gradients given."""
    for (steps_on, state_on, grads_on, *_), (steps_off, state_off, grads_off, *_) in zip(on, off):
        assert [(loss, log) for loss, _, log in steps_on] == [(loss, log) for loss, _, log in steps_off]
        assert state_on.keys() == state_off.keys()
        for k in state_on:
            assert torch.equal(state_on[k], state_off[k]), k
        assert grads_on == grads_off and all(grads_on.values())


def _left(results: list) -> list:
    """Per rank, the forwards it left per step."""
    return [[left for _, left, _ in steps] for steps, *_ in results]


def test_every_rank_but_the_last_stages_leaves_every_forward_from_the_third_step():
    """4 stages, 1F1B: ranks 0-2 leave each of the 4 micro-batches' forwards from step 3 (steps 1-2 learn), the
    last stage none; the values equal one device and the run with whole forwards, bit for bit."""
    steps = 5
    on, off = _both(4, 4, "1f1b", steps)
    assert _left(on) == [[0, 0, 4, 4, 4]] * 3 + [[0] * steps]
    assert _left(off) == [[0] * steps] * 4
    _same(on, off)
    want_losses, _ = reference(4, 8, steps)
    got = [loss for loss, *_ in on[3][0]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want_losses), rtol=0, atol=1e-10)


def test_gpipe_and_interleaved_leave_too():
    for kind, virtual in (("gpipe", 1), ("interleaved", 2)):
        on, off = _both(2, 2, kind, 4, virtual=virtual)
        assert _left(on) == [[0, 0, 4, 4], [0, 0, 0, 0]], kind
        _same(on, off)


def test_pipeline_x_data_x_tensor_and_x_zero_leave_with_the_same_collectives():
    """PP=2 x DP=2 x TP=2 on 8 ranks; PP=2 x ZeRO-3 on 4 (the stage's gathers and reduce-scatters around the exit)."""
    on, off = _both(8, 2, "1f1b", 4, stage_mesh=(2, 2), inner=lambda: tp_plan(1, 2))
    assert _left(on) == [[0, 0, 4, 4]] * 4 + [[0, 0, 0, 0]] * 4
    _same(on, off)
    on, off = _both(4, 2, "1f1b", 4, stage_mesh=(2,), inner=lambda: zero_plan(0, 1))
    assert _left(on) == [[0, 0, 4, 4]] * 2 + [[0, 0, 0, 0]] * 2
    _same(on, off)


def _hooked_run(steps):
    """2 stages, 1F1B; a forward hook on block 3 (the first call after rank 0's last send), and the head's calls
    counted: per step, (forwards left, block 3's hook runs, head calls)."""
    stages = _stages(2, (1,))
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(4)).double(), stages[0], pp_plan(stages, 4))
    calls = {"blocks.3": 0, "head": 0}
    model.blocks[3].register_forward_hook(lambda *a: calls.__setitem__("blocks.3", calls["blocks.3"] + 1))
    pipe = gt.Pipeline(model, microbatches=4, schedule="1f1b", loss_fn=loss_fn)
    head = model.head.__dict__["forward"]  # the head's stage forward, counted (after the pipeline found it)

    def counted(*args, **kwargs):
        calls["head"] += 1
        return head(*args, **kwargs)
    model.head.__dict__["forward"] = counted
    x, t = _data(8)
    seen = []
    for _ in range(steps):
        pipe.step(x, t)
        seen.append((pipe.left_forwards, calls["blocks.3"], calls["head"]))
        calls.update({"blocks.3": 0, "head": 0})
    return seen


def test_a_module_with_a_forward_hook_is_no_exit_and_later_modules_are_not_called():
    """A call whose module has a forward hook runs (leaving there would skip the hook of a call begun); the rank
    leaves at the next call, and the modules after that are not called on it at all. Rank 0 stays until the
    loss in micro-batch 0 (the head moves the tied weight from it) and leaves at the final norm in the others."""
    rank0, rank1 = gt.launch(_hooked_run, 2, args=(4,))
    assert rank0 == [(0, 4, 4), (0, 4, 4), (4, 4, 1), (4, 4, 1)]
    assert rank1 == [(0, 4, 4)] * 4


class _Rerouted(GPT):
    """A GPT whose forward, from a switch set between steps, runs block 0 twice (a changed program)."""
    twice = False

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0 and self.twice:
                x = block(x)
        return self.output(x, targets)


def _switch(model, step):
    model.twice = step >= 3


def test_a_program_changed_before_its_exit_runs_on_and_is_learnt_again():
    """From step 4 block 0 runs twice: the learnt call finds another stage there, so the forwards run whole
    (step 4), the next steps learn the new program (5-6) and leave it (7); the values are the changed
    program's on one device (checked against the whole-forward run)."""
    steps = 8
    on, off = _both(2, 2, "1f1b", steps, model_cls=_Rerouted, program=_switch)
    assert _left(on) == [[0, 0, 4, 0, 0, 0, 4, 4], [0] * steps]
    _same(on, off)


def test_leave_point_is_the_first_call_of_the_outside_tail_after_the_last_message():
    from globaltensor.parallel.early_exit import leave_point
    a, b, c, d = object(), object(), object(), object()
    # (stage, communications before it, inside, may leave)
    notes = ((a, 0, True, False), (b, 0, False, True), (c, 1, False, False), (d, 1, False, True))
    assert leave_point(notes, 1) == (3, (d, 1), (d,))
    assert leave_point(notes, 2) is None                       # a message after the last call: stay
    assert leave_point(notes[:1], 0) is None                   # the last call is its own
    assert leave_point(((b, 0, False, True),), 0) is None     # a rank no message of the forward touches
    notes = ((a, 0, True, False), (b, 1, False, True), (c, 1, False, True))
    assert leave_point(notes, 1) == (1, (b, 1), (b, c))


def _counted_steps(counts: dict, n_ranks: int, kind: str, virtual: int, leave: bool, steps: int = 4):
    """2 stages, on ranks 0 and 1 of `n_ranks` (the others in no stage); per step, how many `_Elsewhere`
    backwards this rank ran (counted into `counts` by the test's patch) and the step's loss where it is held."""
    from globaltensor.runtime import context
    stages = [gt.placement("cpu", [r]) for r in range(2)]
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(2 * virtual)).double(), stages[0], pp_plan(stages, 2 * virtual, virtual=virtual))
    pipe = gt.Pipeline(model, microbatches=2, schedule=kind, loss_fn=loss_fn, leave_early=leave)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = _data(4)
    mine = counts.setdefault(context.current().rank, [0])
    out = []
    for _ in range(steps):
        mine[0] = 0
        loss = pipe.step(x, t)
        opt.step()
        opt.zero_grad()
        out.append((mine[0], pipe.left_forwards, loss.full_tensor().item() if gt.rank() in loss.placement else None))
    return out


@pytest.mark.parametrize("kind,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_a_backward_ends_where_the_ranks_first_stage_began(monkeypatch, kind, virtual):
    """The last stage's backward does not run the empty backwards of the stages before its first chunk (nor does a
    rank in no stage run any): what an outside stage took before the rank's first message has nothing of its
    own. The first stage leaves its forwards; the third rank, in no stage, runs each micro-batch whole."""
    import globaltensor.parallel.stage as gm
    from globaltensor.runtime import context
    counts: dict = {}
    real = gm._Elsewhere.backward

    def counted(ctx, grad):
        counts[context.current().rank][0] += 1
        return real(ctx, grad)
    monkeypatch.setattr(gm._Elsewhere, "backward", staticmethod(counted))
    on = gt.launch(partial(_counted_steps, counts), 3, args=(3, kind, virtual, True))
    off = gt.launch(partial(_counted_steps, counts), 3, args=(3, kind, virtual, False))
    assert [[left for _, left, _ in r] for r in on] == [[0, 0, 2, 2], [0] * 4, [0] * 4]
    assert [loss for *_, loss in on[1]] == [loss for *_, loss in off[1]]
    # from step 2 (stages seen whole): none before the last stage's first chunk; interleaved, one per micro-batch
    # between its chunks (block 2, on the first stage: the boundaries around it send and receive here)
    assert [n for n, *_ in on[1]][1:] == [0 if virtual == 1 else 2] * 3
    assert all(a < b for (a, *_), (b, *_) in zip(on[1][1:], off[1][1:]))
    assert [n for n, *_ in on[2]][1:] == [0, 0, 0] and all(n for n, *_ in off[2][1:])


class _Late(GPT):
    """A GPT whose forward, from a switch set between steps, adds a message from the first stage after the point
    where its rank learnt to leave (the embeddings' mean, moved to the logits' stage)."""
    late = False

    def forward(self, idx, targets=None):
        first = x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.output(x, targets)
        if self.late:
            logits = logits + first.mean().to_global(logits.placement, logits.sbp) * 0
        return logits


def _late(model, step):
    model.late = step >= 3


def test_a_message_added_after_the_learnt_exit_is_an_error_naming_the_opt_out():
    """Step 4 adds a message of the first stage's rank after the point it leaves at: the step ends in an error (no
    hang) that names `leave_early=False`; with it, the changed program trains as the whole-forward run does."""
    with pytest.raises(gt.CollectiveError, match=r"leave_early=False"):
        gt.launch(partial(_trained, model_cls=_Late, program=_late), 2, args=(2, "1f1b", 5, True), timeout=60)
    off = gt.launch(partial(_trained, model_cls=_Late, program=_late), 2, args=(2, "1f1b", 5, False))
    assert [left for _, left, _ in off[0][0]] == [0] * 5
