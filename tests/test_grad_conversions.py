"""A gradient laid out otherwise than its parameter is converted once per step, in the gradient bucket.

An untied GPT under data parallelism whose step has few tokens per rank (8, on 2 ranks): the backward of the
MLP's and the head's weights splits their gradients (each rank the rows of its slice: the tokens' gradients
exchanged) rather than leaving a Partial gradient to all-reduce, while their parameters are Broadcast (until a
parameter's gradient owed its gathering back, `ops/scope.py`'s `grad_sink`, the embedding's was split too, on
the hidden dim). AdamW reads each gradient three times (`lerp_`, and `addcmul_`
with the gradient twice): each read converted it again (three all-gathers of the whole table per step) until
the post-accumulate hook noted it like a Partial one (module.py `_defer_grad_reduction`): converted at the
optimizer's first read, in one all-gather for every such gradient, and remembered while it is unchanged.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch
from globaltensor.runtime.comm import all_reduce_recv_bytes

F64 = 8
T = 8
STEPS = 3


def _setup(cfg: GPTConfig, rows: int, foreach: bool, n: int):
    """The GPT, a batch and AdamW: on one device (n = 0), or data parallel over n ranks."""
    torch.manual_seed(0)
    model = GPT(cfg).double()
    g = torch.Generator().manual_seed(1)
    x, t = (torch.randint(0, cfg.vocab_size, (rows, T), generator=g) for _ in range(2))
    if n:
        mesh = gt.placement("cpu", list(range(n)))
        model = gt.to_global(model, mesh, {})
        x, t = gt.to_global(x, mesh, dp_batch(0, 1)), gt.to_global(t, mesh, dp_batch(0, 1))
    return model, x, t, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)


def _train(cfg: GPTConfig, rows: int, clip: bool, foreach: bool, n: int = 0):
    """AdamW steps on the GPT; on n ranks (n > 0): also, per step, the optimizer phase's collectives
    (kind, bytes) and the gradients' layouts it read."""
    model, x, t, opt = _setup(cfg, rows, foreach, n)
    steps = []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab_size), t.reshape(-1))
        loss.backward()
        layouts = {k: (q.grad._layout, q._layout, q.numel()) for k, q in model.named_parameters()} if n else None
        with gt.comm_log() as log:
            if clip:  # reads every gradient (the bucket's first read), then rescales the reduced ones in place
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=foreach)
            opt.step()
        opt.zero_grad()
        steps.append((layouts, [(e.kind, e.recv_bytes) for e in log.events] if n else None))
    state = {k: (q.full_tensor() if n else q).detach() for k, q in model.state_dict().items()}
    return steps, state


def _run(n, cfg, rows, clip, foreach):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gt.launch(_train, n, args=(cfg, rows, clip, foreach, n))


@example(n=2, rows_per_rank=1, vocab=64, clip=False, foreach=False)
@given(n=st.sampled_from([2, 4]), rows_per_rank=st.integers(1, 2), vocab=st.sampled_from([64, 256]),
       clip=st.booleans(), foreach=st.booleans())
def test_a_gradient_split_otherwise_than_its_parameter_is_moved_once_per_step(n, rows_per_rank, vocab, clip,
                                                                              foreach):
    cfg = GPTConfig(vocab_size=vocab, block_size=T, n_layer=1, n_head=2, n_embd=16, tied_head=False)
    rows = n * rows_per_rank
    _, want = _train(cfg, rows, clip, foreach)
    for steps, state in _run(n, cfg, rows, clip, foreach):
        for k, v in want.items():
            torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-10, msg=k)
        for layouts, events in steps:
            split = [numel for grad, param, numel in layouts.values() if not grad.has_partial and grad != param]
            partial = [numel for grad, param, numel in layouts.values() if grad.has_partial]
            if (n, rows_per_rank) == (2, 1):  # the case this is about (8 tokens a rank): some gradients split
                assert split, layouts
            # every gradient once: the Partial ones in one all-reduce, the split ones in one all-gather
            want_events = [("all_gather", (n - 1) * sum(split) * F64 // n)] if split else []
            if partial:
                want_events.append(("all_reduce", all_reduce_recv_bytes(sum(partial), F64, n, 0)))
            assert sorted(events) == sorted(want_events), (events, want_events)


def _zeroed_in_place(n: int, foreach: bool, tied: bool):
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=1, n_head=2, n_embd=16, tied_head=tied)
    model, x, t, opt = _setup(cfg, 4, foreach, n)
    steps = []
    for _ in range(STEPS):
        with gt.comm_log() as log:
            F.cross_entropy(model(x).reshape(-1, cfg.vocab_size), t.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        steps.append(sorted((e.kind, e.recv_bytes) for e in log.events))
    return steps, {k: (q.full_tensor() if n else q).detach() for k, q in model.state_dict().items()}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_gradients_zeroed_in_place_stay_bucketed(foreach, tied):
    """`zero_grad(set_to_none=False)` zeroes the gradients the bucket reduced into `.grad`: they take back their
    backward's layouts (ops/inputs.py `unsettle`), so every step moves what the first did, in one bucket (before,
    each later backward's accumulation into a reduced gradient reduced its Partial on its own: 23 collectives
    a step instead of 4, the same bytes)."""
    _, want = _zeroed_in_place(0, foreach, tied)
    for steps, state in gt.launch(_zeroed_in_place, 2, args=(2, foreach, tied)):
        for k, v in want.items():
            torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-10, msg=k)
        assert steps[1] == steps[2] == steps[0], steps
        assert len([e for e in steps[0] if e[0] == "all_reduce"]) == 2  # the loss's count and the bucket
