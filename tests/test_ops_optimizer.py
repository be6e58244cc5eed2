"""Optimizer steps reduce each Partial gradient exactly once (in buckets); the memory of reductions is
invalidated by writes."""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_embd=16)
LOCAL_STEPS = {"slice", "fill", "pad"}


def _expected(params, rank):
    """Each gradient boxed once to its parameter's (and optimizer state's) layout, as its route says;
    the routes that are one all-reduce share a collective per bucket (same groups, dtype and op)."""
    kinds, recv, buckets = Counter(), 0, set()
    for p in params:
        route = gt.boxing.route(p.grad.global_layout, p.global_layout, tuple(p.shape), p.dtype)
        key = gt.boxing.all_reduce_key(route)
        for step in route.steps:
            if step.primitive not in LOCAL_STEPS and (key is None or key not in buckets):
                kinds[step.primitive] += 1
        buckets.add(key)
        recv += route.recv_bytes[rank]
    return kinds, recv


def _one_step(foreach):
    torch.manual_seed(0)
    model = GPT(CFG)
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    gt.to_global(model, p, tp_plan(1, 2))
    g = torch.Generator().manual_seed(1)
    idx, tgt = (gt.to_global(torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g), p, dp_batch(0, 2))
                for _ in range(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    model(idx, tgt)[1].backward()
    params = list(model.parameters())
    assert any(q.grad.global_layout.has_partial for q in params)
    want = _expected(params, gt.rank())  # from the gradients as the backward left them (the bucket reduces them in place)
    with gt.comm_log() as log:
        opt.step()
    assert all(q.grad.global_layout == q.global_layout for q in params)  # each gradient its reduced self now
    got = Counter(e.kind for e in log.events)
    return got, log.recv_bytes, want


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_step_reduces_each_partial_gradient_once(foreach):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(_one_step, 4, args=(foreach,))
    for got, recv, (want, want_recv) in results:
        assert got == want and recv == want_recv


def _reuse_and_invalidate():
    p = gt.placement("cpu", [0, 1])
    r = gt.rank()
    y = gt.from_local(torch.arange(4.0) * (r + 1), p, gt.partial_sum)  # global value 3 * arange(4)
    with gt.comm_log() as log:
        a = y.exp()
        b = torch.tanh(y)                 # same Partial read again: no second reduction
    assert len(log.events) == 1
    with gt.comm_log() as log:
        y.mul_(2)                         # in-place through the dispatcher: the reduction is stale
        c = y.exp()
        y.to_local().add_(1)              # a write that bypasses the dispatcher: stale again
        d = y.exp()
    assert len(log.events) == 2
    v = torch.arange(4.0) * 3
    torch.testing.assert_close(a.full_tensor(), v.exp())
    torch.testing.assert_close(b.full_tensor(), v.tanh())
    torch.testing.assert_close(c.full_tensor(), (2 * v).exp())
    torch.testing.assert_close(d.full_tensor(), (2 * v + 2).exp())
    return True


def test_reduction_memory_is_invalidated_by_writes():
    assert all(gt.launch(_reuse_and_invalidate, 2))


def test_optimizers_take_their_foreach_path_for_global_tensors(monkeypatch):
    """torch picks foreach by exact type and device; on a device with foreach kernels (CUDA) a
    GlobalTensor parameter must not force the per-parameter loop (DTensor registers itself too).
    CPU has no foreach kernels in torch's list, so it is put there for this check."""
    import torch.optim.optimizer as optim_module
    import torch.utils._foreach_utils as foreach_utils
    p = torch.nn.Parameter(gt.to_global(torch.randn(4, 2), gt.placement("cpu", [0]), gt.split(0)))
    assert type(p) is gt.GlobalTensor
    monkeypatch.setattr(foreach_utils, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    monkeypatch.setattr(optim_module, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert optim_module._default_to_fused_or_foreach([p], differentiable=False, use_fused=False) == (False, True)
    assert foreach_utils._has_foreach_support([p], torch.device("cpu"))


def _foreach_over_two_stages():
    """A pipeline optimizer's lists: every index one tensor on its stage, this rank's shards of the other
    stage empty. In-place and out-of-place ops, with a scalar list read per index, equal the per-tensor ops;
    new list compositions compile nothing (a rule that always decomposes has one program per op)."""
    from globaltensor.ops import dispatch
    stages = [gt.placement("cpu", [0]), gt.placement("cpu", [1])]
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 2), (5,), (2, 2), (4,)]
    plain = [torch.rand(s, generator=g, dtype=torch.float64) + 0.5 for s in shapes]
    other = [torch.rand(s, generator=g, dtype=torch.float64) for s in shapes]
    xs = [gt.to_global(t.clone(), stages[i % 2], gt.broadcast) for i, t in enumerate(plain)]
    ys = [gt.to_global(t.clone(), stages[i % 2], gt.broadcast) for i, t in enumerate(other)]
    before = dispatch.cache_size()
    roots = torch._foreach_sqrt(xs)
    torch._foreach_addcdiv_(xs, ys, roots, [0.5, -1.0, 2.0, 0.25])
    torch._foreach_mul_(xs[:3], 3.0)
    compiled = dispatch.cache_size() - before
    want = [t + s * o / t.sqrt() for t, o, s in zip(plain, other, [0.5, -1.0, 2.0, 0.25])]
    want = [w * 3.0 if i < 3 else w for i, w in enumerate(want)]
    rank = gt.rank()
    for i, (got, w, r) in enumerate(zip(xs, want, roots)):
        mine = rank in stages[i % 2]
        assert got._local.shape == (w.shape if mine else (0,)) and r._local.shape == got._local.shape
        assert r.global_layout == got.global_layout and tuple(r.shape) == tuple(w.shape)
        if mine:
            torch.testing.assert_close(got._local, w, rtol=0, atol=1e-12)
            torch.testing.assert_close(r._local, plain[i].sqrt(), rtol=0, atol=0)
    return compiled


def test_foreach_over_stages_runs_on_the_shards_that_hold_elements():
    assert gt.launch(_foreach_over_two_stages, 2) == [0, 0]
