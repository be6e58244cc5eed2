"""An optimizer step skips, on each rank, the parameters whose placement leaves that rank out.

A pipeline's optimizer lists every stage's parameters on every rank; those of other stages are empty
shards. The skip must leave exactly the state a full step leaves (moments, step counters, parameters),
on every rank, so checkpoints and later steps cannot tell the difference, and must only apply to
optimizers whose per-parameter state is shards plus a step counter.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.parallel import optim_skip
from globaltensor.models.gpt import GPT, GPTConfig, pp_plan

VOCAB, T, D = 32, 8, 16


def _loss(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


def _optimizer(name: str, params):
    """`name`: the optimizer, then "/foreach" or "/loop" (torch's two implementations of each)."""
    kind, path = name.split("/")
    kw = {"lr": 1e-2, "foreach": path == "foreach"}
    return {"adamw": lambda: torch.optim.AdamW(params, **kw),
            "adam_amsgrad": lambda: torch.optim.Adam(params, amsgrad=True, weight_decay=0.1, **kw),
            "adamax": lambda: torch.optim.Adamax(params, **kw),
            "radam": lambda: torch.optim.RAdam(params, **kw),
            "sgd": lambda: torch.optim.SGD(params, momentum=0.9, **kw),
            "adagrad": lambda: torch.optim.Adagrad(params, **kw),
            "adadelta": lambda: torch.optim.Adadelta(params, **kw),
            "rmsprop": lambda: torch.optim.RMSprop(params, momentum=0.5, **kw),
            "rprop": lambda: torch.optim.Rprop(params, **kw),
            "nadam": lambda: torch.optim.NAdam(params, **kw)}[kind]()


def _pipelined_gpt(n_stages: int, schedule: str, double: bool = False):
    """A GPT of `n_stages` blocks in as many one-rank stages (`pp_plan`), and its Pipeline of 2 micro-batches."""
    stages = [gt.placement("cpu", [r]) for r in range(n_stages)]
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=n_stages, n_head=4, n_embd=D))
    model = gt.to_global(gpt.double() if double else gpt, stages[0], pp_plan(stages, n_stages))
    return model, gt.Pipeline(model, microbatches=2, schedule=schedule, loss_fn=_loss)


def _train(n_stages: int, name: str, skip: bool, steps: int = 3):
    """A GPT in `n_stages` one-rank stages trained by `name`; returns per rank what the optimizer held
    (every state entry: shards as this rank holds them, counters), the parameters' shards, and, per step,
    how many of the other stages' parameters had a gradient during `step()` and after it."""
    optim_skip.ENABLED = skip
    model, pipe = _pipelined_gpt(n_stages, "1f1b", double=True)
    opt = _optimizer(name, model.parameters())
    others = [p for p in model.parameters() if gt.rank() not in p.placement]
    made = sum(p in opt.state for p in others)  # Adagrad makes its state at construction
    seen: list = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(sum(p.grad is not None for p in others)))
    g = torch.Generator().manual_seed(1)
    x, t = torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(0, VOCAB, (4, T), generator=g)
    after = []
    for _ in range(steps):
        pipe.step(x, t)
        opt.step()
        after.append(sum(p.grad is not None for p in others))
        opt.zero_grad()
    state = {(i, k): (v._local.clone() if isinstance(v, gt.GlobalTensor) else
                      v.clone() if isinstance(v, torch.Tensor) else v)
             for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    params = [p._local.clone() for p in model.parameters()]
    return state, params, seen, after, len(others), made


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("n_stages,name", [(2, "adamw/foreach"), (2, "adamw/loop")] + [
    (4, f"{kind}/{path}") for kind in ("adamw", "adam_amsgrad", "adamax", "radam", "sgd", "adagrad", "adadelta",
                                       "rmsprop") for path in ("foreach", "loop")])
def test_a_step_skips_other_stages_parameters_and_leaves_what_a_full_step_leaves(n_stages, name):
    try:
        full = gt.launch(_train, n_stages, args=(n_stages, name, False))
        skipped = gt.launch(_train, n_stages, args=(n_stages, name, True))
    finally:
        optim_skip.ENABLED = True
    for (s0, p0, seen0, after0, others, _), (s1, p1, seen1, after1, _, made) in zip(full, skipped):
        assert others > 0
        _assert_same(s0, s1)  # moments, counters: bit for bit, shards and empty shards alike
        for a, b in zip(p0, p1):
            assert torch.equal(a, b)
        assert seen0 == [others] * 3
        # a parameter is skipped once it has state (the first step makes it, or the constructor)
        assert seen1 == ([0] if made else [others]) + [0, 0] and made in (0, others)
        assert after0 == after1 == [others] * 3  # their (empty) gradients are back after each step


@pytest.mark.parametrize("name", ["nadam/foreach", "rprop/loop"])
def test_an_optimizer_not_known_to_step_parameters_apart_steps_every_parameter(name):
    """NAdam keeps a running product per parameter (skipping would leave it behind); Rprop writes through a
    mask, a data-dependent op whose shape the ranks outside learn from those inside: nothing is skipped, and
    the run is the full one."""
    for _, _, seen, _, others, _ in gt.launch(_train, 2, args=(2, name, True)):
        assert seen == [others] * 3


def test_a_step_that_raises_gives_the_gradients_back_at_the_next_step():
    def body():
        model, pipe = _pipelined_gpt(2, "gpipe")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randint(0, VOCAB, (4, T))
        pipe.step(x, x)
        opt.step()  # state made
        pipe.step(x, x)
        handle = opt.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        handle.remove()
        others = [p for p in model.parameters() if gt.rank() not in p.placement]
        hidden_after_raise = sum(p.grad is None for p in others)
        opt.step()
        return hidden_after_raise, sum(p.grad is None for p in others), len(others)

    for hidden, after, others in gt.launch(body, 2):
        assert others > 0 and hidden == others  # the raise left them hidden ...
        assert after == 0                         # ... the next step put them back


def test_a_pipeline_checkpoint_holds_every_parameters_state_on_every_rank(tmp_path):
    """The skipped parameters keep their (empty) state and counters: a training checkpoint loads back."""
    from globaltensor import checkpoint

    def body(path):
        model, pipe = _pipelined_gpt(2, "1f1b")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(2))
        for _ in range(3):
            pipe.step(x, x)
            opt.step()
            opt.zero_grad()
        checkpoint.save_training(path, model, opt, step=3)
        steps = sorted({float(s["step"]) for s in opt.state.values()})
        opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert checkpoint.load_training(path, model, opt2) == 3
        return steps, sorted({float(s["step"]) for s in opt2.state.values()})

    for steps, loaded in gt.launch(body, 2, args=(str(tmp_path / "ckpt"),)):
        assert steps == loaded == [3.0]
