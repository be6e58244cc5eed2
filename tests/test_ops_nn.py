"""softmax/log_softmax, layer norm, RMS norm, embedding (vocab-parallel), cross-entropy, SDPA vs one device."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from ops_support import check, meshes, mesh_placement, sbps_for

aten = torch.ops.aten
D = torch.float64


@settings(max_examples=12)
@given(meshes(), st.integers(1, 4), st.integers(1, 5), st.integers(2, 6), st.data())
def test_softmax_norms(mesh, b, s, h, data):
    shape = (b, s, h)
    torch.manual_seed(4)
    x, w, bias = torch.randn(shape, dtype=D), torch.randn(h, dtype=D), torch.randn(h, dtype=D)
    sx = data.draw(sbps_for(mesh, shape))
    sw = data.draw(sbps_for(mesh, (h,)))
    fns = {
        "softmax": lambda x, w, b: F.softmax(x, -1) * w + F.log_softmax(x, 1).sum(1, keepdim=True),
        "safe_softmax": lambda x, w, b: aten._safe_softmax.default(x.masked_fill(x > 1.0, float("-inf")), 1) * w,
        "layer_norm": lambda x, w, b: F.layer_norm(x, (h,), w, b),
        "rms_norm": lambda x, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w + b,
    }
    for f in fns.values():
        check(f, [x, w, bias], mesh, [sx, sw, sw])


@given(meshes(), st.integers(3, 9), st.data())
def test_embedding_and_cross_entropy(mesh, vocab, data):
    torch.manual_seed(5)
    w = torch.randn(vocab, 4, dtype=D)
    idx = torch.randint(0, vocab, (3, 5))
    tgt = torch.randint(0, vocab, (15,))
    sw = data.draw(sbps_for(mesh, (vocab, 4)))
    si = data.draw(sbps_for(mesh, (3, 5)))
    st_ = data.draw(sbps_for(mesh, (15,)))

    def f(w, idx, tgt):
        e = F.embedding(idx, w)
        logits = e.reshape(15, 4) @ w.t()
        return F.cross_entropy(logits, tgt) + F.cross_entropy(logits, tgt, reduction="sum") / 7
    check(f, [w, idx, tgt], mesh, [sw, si, st_])


def test_vocab_parallel_embedding_gives_partial_without_communication():
    def body():
        p = mesh_placement((2,))
        # a vocab (64 rows) larger than the tokens looked up: moving the table would cost more than the
        # output's reduction, so the output stays Partial (a 5-row table is cheaper to all-to-all)
        w = gt.to_global(torch.arange(128.0).reshape(64, 2), p, gt.split(0))
        idx = gt.to_global(torch.tensor([[0, 63, 2]]), p, gt.broadcast)
        with gt.comm_log() as log:
            e = F.embedding(idx, w)
        return e.sbp, log.recv_bytes, e.full_tensor()
    sbp, received, full = gt.launch(body, 2)[0]
    assert sbp == (gt.partial_sum,) and received == 0
    assert torch.equal(full, torch.arange(128.0).reshape(64, 2)[[0, 63, 2]].unsqueeze(0))


@given(meshes(), st.integers(1, 3), st.sampled_from([2, 4]), st.integers(1, 6), st.booleans(), st.data())
def test_sdpa(mesh, b, nh, s, causal, data):
    shape = (b, nh, s, 4)
    torch.manual_seed(6)
    q, k, v = (torch.randn(shape, dtype=D) for _ in range(3))
    sbp = data.draw(sbps_for(mesh, shape))
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), [q, k, v], mesh, [sbp] * 3)


def test_sdpa_heads_split_is_free():
    def body():
        p = mesh_placement((2,))
        q = gt.to_global(torch.randn(2, 4, 3, 8), p, gt.split(1)).requires_grad_()
        with gt.comm_log() as log:
            o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            o.sum().backward()
        return o.sbp, q.grad.sbp, log.recv_bytes
    assert gt.launch(body, 2)[0] == ((gt.split(1),), (gt.split(1),), 0)


@given(meshes(), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.sampled_from(["none", "sum", "mean"]),
       st.data())
def test_mse_loss(mesh, shape, reduction, data):
    shape = tuple(shape)
    torch.manual_seed(7)
    x, y = torch.randn(shape, dtype=D), torch.randn(shape, dtype=D)
    sx, sy = data.draw(sbps_for(mesh, shape, partial=True)), data.draw(sbps_for(mesh, shape, partial=True))
    check(lambda x, y: F.mse_loss(x, y, reduction=reduction) * 2, [x, y], mesh, [sx, sy])


def test_batch_split_mse_mean_is_partial_without_communication():
    def body():
        p = mesh_placement((2,))
        x = gt.to_global(torch.arange(10.0).reshape(5, 2), p, gt.split(0)).requires_grad_()
        y = gt.to_global(torch.ones(5, 2), p, gt.split(0))
        with gt.comm_log() as log:
            loss = F.mse_loss(x, y)
        loss.backward()
        return loss.sbp, log.recv_bytes, loss.full_tensor(), x.grad.sbp, x.grad.full_tensor()
    sbp, received, loss, gsbp, grad = gt.launch(body, 2)[0]
    x = torch.arange(10.0).reshape(5, 2)
    assert sbp == (gt.partial_sum,) and received == 0 and gsbp == (gt.split(0),)
    torch.testing.assert_close(loss, F.mse_loss(x, torch.ones(5, 2)))
    torch.testing.assert_close(grad, 2 * (x - 1) / 10)
