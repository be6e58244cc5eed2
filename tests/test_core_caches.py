"""Bounded caches: a training loop whose shapes change every step keeps its memory flat.

Every new sequence length is a new decision key (and new interned tensor keys and boxing plans);
the dispatcher's program cache evicts its oldest entries, tensor keys are interned weakly, plans
sit in bounded LRU caches, and a cached decision holds meta stand-ins, never the call's tensors.
"""
from __future__ import annotations

import gc
import os

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
