"""Bounded caches: a training loop whose shapes change every step keeps its memory flat.

Every new sequence length is a new decision key (and new interned tensor keys and boxing routes);
the dispatcher's program cache evicts its oldest entries, tensor keys are interned weakly, routes
sit in bounded LRU caches, and a cached decision holds meta stand-ins, never the call's tensors.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

import globaltensor as gt
from globaltensor.ops import dispatch, keys


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _train(steps: int, start: int):
    p = gt.placement("cpu", [0, 1])
    torch.manual_seed(0)
    w = gt.to_global(torch.randn(64), p, gt.broadcast).requires_grad_()
    sizes = []
    for step in range(start, start + steps):
        seq = 2 + (step * 37) % 2000  # 2,000 steps, 2,000 distinct lengths: every op's key is new
        x = gt.to_global(torch.randn(seq, 64), p, gt.split(0))  # activations up to 0.5 MB: pinning them would show
        loss = (x * w).sum()
        loss.backward()
        with torch.no_grad():
            w.sub_(w.grad, alpha=1e-3)
        w.grad = None
        if step - start in (steps // 2 - 1, steps - 1):
            gc.collect()
            sizes.append((_rss_mb(), dispatch.cache_size(), len(keys._TENSOR_KEYS)))
    return sizes


@pytest.mark.slow  # ~50 s: 2,000 programs
def test_two_thousand_changing_shapes_keep_memory_flat(monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_PROGRAMS", 2048)  # reach the bound within the test's steps
    dispatch.clear_cache()
    results = gt.launch(_train, 2, args=(2000, 0))
    (rss_q, cache_q, keys_q), (rss_end, cache_end, keys_end) = results[0]
    assert cache_end <= 2048 and cache_q <= 2048
    assert keys_end <= 4 * 2048  # interned keys live only while a tensor or a cached decision holds them
    # the second 1,000 steps (the bounded caches are full by then), each with new activations (pinned,
    # they would add ~250 MB) and new decisions, leave the resident memory where it was
    assert rss_end - rss_q < 16, f"resident memory grew {rss_end - rss_q:.1f} MB from step 1000 to 2000"


def _first_step_leaves_no_tensor_in_a_cycle():
    """A first step is all dispatcher misses (decisions made, programs compiled). Nothing they keep may
    hold the step's tensors in a reference cycle: such tensors live until the cyclic gc happens to run
    (with a ZeRO-3 GPT, step 0's activations and gradients were alive at step 1's peak). The model and
    optimizer stay reachable here, so what a collection finds is what the step left unreachable."""
    from globaltensor.models.gpt import GPT, GPTConfig, zero_plan
    from globaltensor.runtime import context
    p = gt.placement("cpu", [0, 1])
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = gt.to_global(GPT(cfg), p, zero_plan(0, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(1)
    idx, tgt = (gt.to_global(torch.randint(0, 32, (4, 8), generator=g), p, gt.split(0)) for _ in range(2))
    model(idx, tgt)[1].backward()
    opt.step()
    opt.zero_grad()
    comm = context.current()
    comm.barrier()
    caught = []
    if comm.rank == 0:  # one collection for the whole process (the simulated ranks are its threads)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        caught = [(id(o), tuple(o.shape)) for o in gc.garbage if isinstance(o, torch.Tensor)]
        gc.set_debug(0)
        gc.garbage.clear()
    comm.barrier()
    return caught, model, opt


def test_a_first_step_leaves_no_tensor_in_a_reference_cycle():
    gc.collect()
    # what earlier tests in this process left alive is not this step's: some is dropped while the step runs (an
    # auto_plan test's MoE-GPT experts), and a collection then finds it
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    gc.disable()
    try:
        caught = gt.launch(_first_step_leaves_no_tensor_in_a_cycle, 2)[0][0]
    finally:
        gc.enable()
    caught = [shape for key, shape in caught if key not in before]
    assert not caught, f"{len(caught)} tensors freed only by the cyclic gc, e.g. {caught[:8]}"
