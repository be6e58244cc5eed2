"""The rules of attention's CUDA kernels (`ops/attention_cuda.py`), checked on the CPU.

Those kernels have no CPU implementation, and CI has no GPU; the rules only read shapes and layouts.
So this module gives the aten ops CPU stand-ins for as long as it runs (torch's CPU flash kernel
behind each CUDA op's signature, with the memory-efficient kernel's log-sum-exp padded to 32 rows as
CUDA pads it) and checks that every layout of q, k, v runs with no fallback, equals one device, and
moves only what converting the inputs into a batch or heads split moves. `tests/test_cuda.py` runs the
real kernels on a GPU.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import globaltensor as gt

aten = torch.ops.aten
S0, S1, S2, B = gt.split(0), gt.split(1), gt.split(2), gt.broadcast
_flash, _flash_backward = aten._scaled_dot_product_flash_attention_for_cpu, \
    aten._scaled_dot_product_flash_attention_for_cpu_backward


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse = _flash(q, k, v, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
    padded = q.new_zeros(*lse.shape[:2], math.ceil(lse.shape[2] / 32) * 32)
    padded[..., :lse.shape[2]] = lse
    seed = torch.empty((), dtype=torch.int64)
    return out, padded, seed, seed.clone()


def _efficient_backward(grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                        is_causal=False, *, scale=None):
    gq, gk, gv = _flash_backward(grad, q, k, v, out, lse[..., :q.shape[2]].contiguous(), dropout_p, is_causal,
                                 attn_mask=attn_bias, scale=scale)
    return gq, gk, gv, (torch.zeros_like(attn_bias) if attn_bias is not None and grad_input_mask[3]
                        else torch.empty(0))


def _flash_cuda(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _flash(q, k, v, dropout_p, is_causal, scale=scale)
    e = torch.empty(0)
    return out, lse, e, e.clone(), q.shape[2], k.shape[2], torch.zeros(2, dtype=torch.int64), e.clone(), e.clone()


def _flash_cuda_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset,
                         *, scale=None):
    return _flash_backward(grad, q, k, v, out, lse, dropout_p, is_causal, scale=scale)


@pytest.fixture(scope="module", autouse=True)
def cpu_stand_ins():
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in (("_scaled_dot_product_efficient_attention", _efficient),
                     ("_scaled_dot_product_efficient_attention_backward", _efficient_backward),
                     ("_scaled_dot_product_flash_attention", _flash_cuda),
                     ("_scaled_dot_product_flash_attention_backward", _flash_cuda_backward)):
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


def _attend(kernel: str, q, k, v, causal: bool):
    if kernel == "efficient":
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[0]
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]


SHAPE = (3, 4, 5, 2)  # batch and heads uneven on 2 and 4 ranks


def _run(kernel: str, mesh: tuple, sbps: tuple, causal: bool):
    p = gt.placement("cpu", torch.arange(math.prod(mesh)).reshape(mesh).tolist())
    xs = [gt.to_global(x, p, sbp).requires_grad_() for x, sbp in zip(_inputs(), sbps)]
    before = Counter(gt.stats()["fallback"])  # the counts are the process's: earlier tests' fallbacks are not ours
    with gt.comm_log() as log:
        y = _attend(kernel, *xs, causal)
        grad = gt.to_global(torch.arange(math.prod(SHAPE), dtype=torch.float64).reshape(SHAPE).cos(), p, y.sbp)
        (y * grad).sum().backward()
    return (y.full_tensor(), [x.grad.full_tensor() for x in xs], log.recv_bytes,
            dict(Counter(gt.stats()["fallback"]) - before))


def _inputs() -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, dtype=torch.float64, generator=g) for _ in range(3)]


def _one_device(kernel: str, causal: bool):
    xs = [x.requires_grad_() for x in _inputs()]
    y = _attend(kernel, *xs, causal)
    (y * torch.arange(math.prod(SHAPE), dtype=torch.float64).reshape(SHAPE).cos()).sum().backward()
    return y.detach(), [x.grad for x in xs]


LAYOUTS = st.sampled_from([(S0,), (S1,), (B,), (S2,)])


@settings(deadline=None)
@given(kernel=st.sampled_from(["efficient", "flash"]), mesh=st.sampled_from([(2,), (4,), (2, 2)]),
       sbps=st.tuples(LAYOUTS, LAYOUTS, LAYOUTS, LAYOUTS, LAYOUTS, LAYOUTS), causal=st.booleans())
def test_cuda_attention_kernels_run_on_any_layout_as_one_device_with_no_fallback(kernel, mesh, sbps, causal):
    per_input = tuple(sum(sbps[i * len(mesh):(i + 1) * len(mesh)], ()) for i in range(3))
    want = _one_device(kernel, causal)
    for got in gt.launch(_run, math.prod(mesh), args=(kernel, mesh, per_input, causal)):
        y, grads, _, fallback = got
        assert not fallback, fallback
        torch.testing.assert_close(y, want[0], rtol=1e-12, atol=1e-12)
        for g, w in zip(grads, want[1]):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["efficient", "flash"])
@pytest.mark.parametrize("sbp", [S0, S1])
def test_cuda_attention_on_a_batch_or_heads_split_moves_nothing(kernel, sbp):
    for _, _, received, fallback in gt.launch(_run, 2, args=(kernel, (2,), ((sbp,),) * 3, True)):
        assert received == 0 and not fallback
