"""Pipeline(replay=True): a rank runs its recorded part of each micro-batch instead of the global program.

Every case trains against the same program on one device (fp64, 1e-10) and checks what was replayed and
what was not (with the reason), and that a replayed step sends exactly the program's messages.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
import torch

import globaltensor as gt
from globaltensor.models.gpt import GPT, dp_batch, pp_plan
from test_pipeline import D, T, VOCAB, _cfg, _check_values, _data, _stages, loss_fn, reference


def _trained(n_stages, n_layer, kind, micro, batch, steps, virtual=1, tied_head=False, stage_mesh=(1,), change=None,
             hook_at=None):
    """Returns (losses, state, held, events per step, replaying per step, why, hooked calls, receives learnt per step). `change`: the step from which the
    batch has one row less (its shapes change); `hook_at`: the step before which a forward hook is put on a stage."""
    stages = _stages(n_stages, stage_mesh)
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(n_layer, tied_head)).double(), stages[0],
                         pp_plan(stages, n_layer, virtual=virtual, tied_head=tied_head))
    sbp = dp_batch(0, len(stage_mesh)) if stage_mesh[0] > 1 else None
    pipe = gt.Pipeline(model, microbatches=micro, schedule=kind, loss_fn=loss_fn, replay=True, input_sbp=sbp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = _data(batch)
    losses, events, replaying, seen, learnt = [], [], [], [], []
    for k in range(steps):
        if hook_at == k:
            model.blocks[-1].register_forward_hook(lambda mod, args, out: seen.append(k))
        xs, ts = (x[:-1], t[:-1]) if change is not None and k >= change else (x, t)
        with gt.comm_log() as log:
            loss = pipe.step(xs, ts)
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        events.append([(e.kind, e.group, e.recv_bytes) for e in log.events])
        replaying.append(pipe.replaying)
        learnt.append(pipe._learnt.receives.learnt is not None)  # receives posted ahead: learnt by the program, kept by the replay
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    held = {k: gt.rank() in v.placement for k, v in model.state_dict().items()}
    return losses, state, held, events, replaying, pipe.replay_why, seen, learnt


@pytest.mark.parametrize("n_stages", [2, 4])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_replayed_steps_train_as_one_device_with_the_programs_messages(n_stages, kind):
    """Steps 2 and 3 record each rank's part (the first runs the program whole), equal: replayed from step 4 on,
    every rank, with the same messages (kind, peers, bytes, in order) as a step of the program."""
    virtual = 2 if kind == "interleaved" else 1
    n_layer, micro, batch, steps = 4 * virtual, 4, 8, 6
    want_losses, want_state = reference(n_layer, batch, steps, tied_head=False)
    results = gt.launch(_trained, n_stages, args=(n_stages, n_layer, kind, micro, batch, steps, virtual))
    _check_values(results, want_losses, want_state)
    act = batch // micro * T * D * 8  # one micro-batch's activation (or its gradient), fp64
    last = n_stages * virtual - 1
    for stage, (losses, state, held, events, replaying, why, _, learnt) in enumerate(results):
        assert replaying == [False] * 3 + [True] * 3, why
        assert why == ""
        assert events[3] == events[4] == events[5] == events[2]  # the program's messages, replayed
        chunks = [c * n_stages + stage for c in range(virtual)]  # the textbook: activations and gradients only
        assert sum(e[2] for e in events[5]) == micro * act * (sum(vs > 0 for vs in chunks) +
                                                              sum(vs < last for vs in chunks))
        assert learnt == [False] + [True] * 5  # and the same receives: posting them ahead goes on


@pytest.mark.parametrize("n_stages,kind", [(2, "1f1b"), (4, "1f1b"), (2, "interleaved"), (4, "gpipe")])
def test_the_tied_head_replays_its_weights_gather_and_its_gradients_return(n_stages, kind):
    """The GPT as written (head tied to the embedding): its weight goes to the last stage once per step and the
    head's gradient, summed over the micro-batches, comes back. A replay runs the head's gather hooks where the
    program ran them (`zero.ParamGroup.before`/`after`, recorded around the stage call: the gather's own messages),
    and the step's end as the program does; the first stage, outside the head, gives its gather its empty gradient
    share (`replay.give_empty_grads`) so that it receives the head's. Values equal one device; the replayed steps' messages
    are the program's (whose bytes test_pipeline counts against the textbook). The first stages replay a step later
    than the last: their first recording still called the head (no exit learnt yet), the next ones do not."""
    virtual = 2 if kind == "interleaved" else 1
    n_layer, micro, batch, steps = 4 * virtual, 4, 8, 6
    want_losses, want_state = reference(n_layer, batch, steps)
    results = gt.launch(_trained, n_stages, args=(n_stages, n_layer, kind, micro, batch, steps, virtual, True))
    _check_values(results, want_losses, want_state)
    for stage, (_, _, _, events, replaying, why, _, _) in enumerate(results):
        assert why == "" and replaying[4:] == [True, True], (stage, why, replaying)
        assert replaying[:3] == [False] * 3 and replaying[3] == (stage == n_stages - 1)
        assert events[5] == events[4] == events[2]
        tied = [e for e in events[5] if e[2] == VOCAB * D * 8]  # the weight's one move each way
        assert len(tied) == (1 if stage in (0, n_stages - 1) else 0)


def test_a_stage_of_several_ranks_keeps_the_program_and_says_why():
    """Stages of two ranks (data parallel inside a stage: collectives): not replayed, values equal one device."""
    n_layer, micro, batch, steps = 4, 2, 8, 5
    want_losses, want_state = reference(n_layer, batch, steps, tied_head=False)
    results = gt.launch(_trained, 4, args=(2, n_layer, "1f1b", micro, batch, steps, 1, False, (2,)))
    _check_values(results, want_losses, want_state)
    for r in results:
        assert not any(r[4]) and "several ranks" in r[5], r[5]


def test_replay_stops_where_the_inputs_change_and_resumes_once_two_steps_agree_again():
    """From step 5 the batch has a row less: the program runs (a new signature) and records steps 5 and 6, equal:
    replayed from step 7 on."""
    n_layer, micro, batch, steps = 4, 4, 9, 9
    want_losses, _ = reference(n_layer, batch, 5, tied_head=False)
    results = gt.launch(_trained, 2, args=(2, n_layer, "1f1b", micro, batch, steps, 1, False, (1,), 5))
    for losses, state, held, events, replaying, why, *_ in results:
        assert replaying == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2, replaying
        got = [x for x in losses if x is not None]
        if got:
            assert abs(got[4] - want_losses[4]) < 1e-10
    # the whole run against one device trained on the same batches
    torch.manual_seed(0)
    model = GPT(_cfg(n_layer, False)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = _data(batch)
    want = []
    for k in range(steps):
        xs, ts = (x[:-1], t[:-1]) if k >= 5 else (x, t)
        loss = loss_fn(model(xs), ts)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    _check_values(results, want, {k: v.detach() for k, v in model.state_dict().items()})


def test_a_hook_put_on_a_stage_after_replay_began_runs_the_program_again():
    """A replay calls a stage's class forward, not the module: a forward hook registered later would be skipped, so
    the rank that calls that stage goes back to the program (the hook runs, once per micro-batch); the first stage,
    which never calls it (it leaves each forward after its send), replays on."""
    n_layer, micro, batch, steps = 4, 2, 8, 6
    want_losses, want_state = reference(n_layer, batch, steps, tied_head=False)
    results = gt.launch(_trained, 2, args=(2, n_layer, "1f1b", micro, batch, steps, 1, False, (1,), None, 4))
    _check_values(results, want_losses, want_state)
    (*_, replaying0, why0, seen0, _), (*_, replaying1, why1, seen1, _) = results
    assert replaying0 == [False] * 3 + [True] * 3 and why0 == "" and seen0 == []
    assert replaying1 == [False] * 3 + [True] + [False] * 2 and "hooks" in why1, (replaying1, why1)
    assert seen1 == [4] * micro + [5] * micro


def _mixed(steps: int, report_at: int):
    """Rank 0's first block carries a forward hook from the start (so rank 0 runs the program), rank 1 replays; at
    step `report_at` a comm_report is open (every rank runs the program, as the report needs its modules' frames)."""
    stages = _stages(2, (1,))
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(4, False)).double(), stages[0], pp_plan(stages, 4, tied_head=False))
    calls = []
    model.blocks[0].register_forward_hook(lambda mod, args, out: calls.append(1))
    pipe = gt.Pipeline(model, microbatches=2, schedule="1f1b", loss_fn=loss_fn, replay=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = _data(8)
    losses, replaying = [], []
    for k in range(steps):
        if k == report_at:
            with gt.comm_report(model):
                loss = pipe.step(x, t)
        else:
            loss = pipe.step(x, t)
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        replaying.append(pipe.replaying)
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    held = {k: gt.rank() in v.placement for k, v in model.state_dict().items()}
    return losses, state, held, replaying, pipe.replay_why, len(calls)


def test_a_rank_on_the_program_and_a_rank_replaying_exchange_as_before():
    """Each rank decides alone: rank 0 (a hooked stage) runs the program throughout, rank 1 replays from step 3
    except while a comm_report is open on it (step 4); the messages match and training equals one device."""
    steps = 6
    want_losses, want_state = reference(4, 8, steps, tied_head=False)
    results = gt.launch(_mixed, 2, args=(steps, 4))
    _check_values(results, want_losses, want_state)
    (_, _, _, replaying0, why0, calls0), (_, _, _, replaying1, why1, calls1) = results
    assert replaying0 == [False] * steps and "hooks" in why0 and calls0 == 2 * steps
    assert replaying1 == [False] * 3 + [True, False, True] and why1 == ""
    # rank 1 called the hooked module (outside its stage, on empty shards) only in the steps it ran the program: a
    # replaying rank calls its own stages only, as it calls none after its last send when it leaves early
    assert calls1 == 2 * 4


def _failing_at(step: int, schedule: str):
    stages = _stages(2, (1,))
    torch.manual_seed(0)
    virtual = 2 if schedule == "interleaved" else 1
    model = gt.to_global(GPT(_cfg(2 * virtual, False)).double(), stages[0],
                         pp_plan(stages, 2 * virtual, virtual=virtual, tied_head=False))
    steps = [0]

    def bad_loss(out, tgt):
        if gt.rank() == 1 and steps[0] == step:
            raise RuntimeError("stage 1 broke while replaying")
        return loss_fn(out, tgt)
    pipe = gt.Pipeline(model, microbatches=2, schedule=schedule, loss_fn=bad_loss, replay=True)
    for k in range(step + 1):
        steps[0] = k
        pipe.step(*_data(4))
        assert pipe.replaying == (k >= 3)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_stage_failing_in_a_replayed_step_ends_every_rank_with_its_error(schedule):
    with pytest.raises(Exception, match="stage 1 broke while replaying"):
        gt.launch(_failing_at, 2, args=(4, schedule), timeout=20)


def _peaks(kind: str) -> list:
    stages = _stages(2, (1,))
    torch.manual_seed(0)
    virtual = 2 if kind == "interleaved" else 1
    model = gt.to_global(GPT(_cfg(4, False)).double(), stages[0], pp_plan(stages, 4, virtual=virtual, tied_head=False))
    pipe = gt.Pipeline(model, microbatches=4, schedule=kind, loss_fn=loss_fn, replay=True, measure_activations=True)
    out = []
    for _ in range(5):
        pipe.activations.peak = pipe.activations.live
        pipe.step(*_data(8))
        out.append((pipe.replaying, pipe.activations.peak, pipe.activations.live))
    return out


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_a_replayed_step_holds_the_activations_the_programs_step_holds(kind):
    """`measure_activations=True` counts what autograd saves in replayed steps too: the same bytes at the peak as a
    step of the program (a replay keeps only what the backward reads besides), none left after the step."""
    for steps in gt.launch(_peaks, 2, args=(kind,)):
        assert [r for r, _, _ in steps] == [False] * 3 + [True] * 2
        assert steps[3][1] == steps[4][1] == steps[2][1] > 0
        assert all(live == 0 for _, _, live in steps)


def test_a_rank_outside_every_stage_replays_nothing_and_the_stages_train_as_one_device():
    """A world of three over two one-rank stages: rank 2 holds no stage; its tapes are empty (no message is its),
    so it replays too, with nothing to run."""
    n_layer, micro, batch, steps = 4, 2, 8, 5
    want_losses, want_state = reference(n_layer, batch, steps, tied_head=False)
    results = gt.launch(_trained, 3, args=(2, n_layer, "1f1b", micro, batch, steps))
    _check_values(results[:2], want_losses, want_state)
    for losses, state, held, events, replaying, why, *_ in results:
        assert replaying == [False] * 3 + [True] * 2, why
    assert results[2][3][-1] == [] and not any(results[2][2].values())


def test_replay_under_gloo_trains_the_tied_gpt_as_one_device():
    """Real processes (the only replay run off the simulator in the suite): the GPT as written on 2 gloo ranks,
    1F1B; every rank replays the last two steps with the program's messages, values equal one device. Under the
    simulator the ranks share the modules' and groups' Python state; here each process has its own."""
    n_layer, micro, batch, steps = 4, 4, 8, 6
    want_losses, want_state = reference(n_layer, batch, steps)
    results = gt.launch(_trained, 2, backend="gloo", timeout=120,
                        args=(2, n_layer, "1f1b", micro, batch, steps, 1, True))
    _check_values(results, want_losses, want_state)
    for stage, (_, _, _, events, replaying, why, _, _) in enumerate(results):
        assert why == "" and replaying[4:] == [True, True], (stage, why, replaying)
        assert events[5] == events[2]


@settings(deadline=None, max_examples=max(4, settings.default.max_examples // 3))  # each example trains 2-3 ranks
@given(n_stages=st.integers(2, 3), extra_layers=st.integers(0, 2), micro=st.integers(1, 5), batch=st.integers(3, 7),
       kind=st.sampled_from(["gpipe", "1f1b", "interleaved"]), tied=st.booleans())
def test_replay_hypothesis_splits_microbatches_schedules_tied_or_not(n_stages, extra_layers, micro, batch, kind, tied):
    """Uneven layer counts per stage, micro-batches that do not divide the batch (two sizes), every schedule, the
    head tied or not: six steps, every rank replaying the last (the first stages, with the tied head, from the fifth
    step), values equal one device, the replayed step's messages the program's."""
    micro = min(micro, batch)
    virtual = 1
    if kind == "interleaved":
        virtual, micro = 2, max(n_stages, micro - micro % n_stages)
    n_layer = n_stages * virtual + extra_layers
    steps = 6
    want_losses, want_state = reference(n_layer, batch, steps, tied_head=tied)
    results = gt.launch(_trained, n_stages, args=(n_stages, n_layer, kind, micro, batch, steps, virtual, tied))
    _check_values(results, want_losses, want_state)
    for stage, (_, _, _, events, replaying, why, _, _) in enumerate(results):
        assert why == "" and replaying[-2:] == [True, True], (stage, why, replaying)
        assert events[-1] == events[2]
