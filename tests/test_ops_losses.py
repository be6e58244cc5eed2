"""Losses (ops/loss.py) on any layout: values and gradients equal one device's for every reduction;
a split loss reduced ('sum', 'mean') is P, computed with nothing moved, and reading it is one all-reduce
of one element ('mean' divides each rank's sum by the global count, so the shards add up to the mean)."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor.runtime.comm import all_reduce_recv_bytes
from ops_support import Mesh, check, mesh_placement, meshes, sbps_for

MESHES = [(2,), (3,), (4,), (2, 2)]
F64 = torch.float64
REDUCTIONS = ["none", "sum", "mean"]


def _inputs(name: str) -> list:
    """The loss's tensors (floating ones get gradients), 5 samples: uneven on 2 and 4 ranks."""
    torch.manual_seed(8)
    x = torch.randn(5, 4, dtype=F64)
    if name == "bce":
        return [torch.rand(5, 4, dtype=F64) * 0.9 + 0.05, torch.rand(5, 4, dtype=F64), torch.rand(4, dtype=F64)]
    if name == "bce_logits":
        return [x, torch.rand(5, 4, dtype=F64), torch.rand(5, 4, dtype=F64), torch.rand(4, dtype=F64) + 0.5]
    if name in ("huber", "smooth_l1"):
        return [x * 2, torch.randn(5, 4, dtype=F64)]
    if name == "soft_margin":
        return [x, torch.randint(0, 2, (5, 4)).to(F64) * 2 - 1]
    if name == "multi_margin":
        return [x, torch.randint(0, 4, (5,)), torch.rand(4, dtype=F64)]
    if name == "multilabel_margin":
        return [x, torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3], [1, -1, 0, 0], [2, 2, -1, 0], [-1, 0, 0, 0]])]
    if name == "cross_entropy_2d":
        return [torch.randn(5, 3, 4, 3, dtype=F64), torch.randint(0, 3, (5, 4, 3)), torch.rand(3, dtype=F64)]
    if name == "logsigmoid":
        return [x]
    raise KeyError(name)


def _loss(name: str, reduction: str, weighted: bool):
    if name == "bce":
        return lambda x, t, w: F.binary_cross_entropy(x, t, w if weighted else None, reduction=reduction)
    if name == "bce_logits":
        return lambda x, t, w, pw: F.binary_cross_entropy_with_logits(x, t, w if weighted else None,
                                                                      reduction=reduction, pos_weight=pw)
    if name == "huber":
        return lambda x, t: F.huber_loss(x, t, reduction=reduction, delta=0.7)
    if name == "smooth_l1":
        return lambda x, t: F.smooth_l1_loss(x, t, reduction=reduction, beta=0.5)
    if name == "soft_margin":
        return lambda x, t: F.soft_margin_loss(x, t, reduction=reduction)
    if name == "multi_margin":
        return lambda x, t, w: F.multi_margin_loss(x, t, p=2, margin=0.7, weight=w if weighted else None,
                                                   reduction=reduction)
    if name == "multilabel_margin":
        return lambda x, t: F.multilabel_margin_loss(x, t, reduction=reduction)
    if name == "cross_entropy_2d":
        return lambda x, t, w: F.cross_entropy(x, t, w if weighted else None, ignore_index=1, reduction=reduction)
    if name == "logsigmoid":
        return lambda x: F.logsigmoid(x)
    raise KeyError(name)


NAMES = ["bce", "bce_logits", "huber", "smooth_l1", "soft_margin", "multi_margin", "multilabel_margin",
         "cross_entropy_2d", "logsigmoid"]


@given(meshes(MESHES), st.sampled_from(NAMES), st.sampled_from(REDUCTIONS), st.booleans(), st.data())
def test_losses_match_one_device(mesh, name, reduction, weighted, data):
    """Every tensor laid out at random (any dim split, Broadcast): one device's loss and gradients."""
    xs = _inputs(name)
    sbps = [data.draw(sbps_for(mesh, tuple(t.shape))) for t in xs]
    loss = _loss(name, reduction, weighted)
    check(lambda x, *rest: loss(x, *[r.detach() for r in rest]), xs, mesh, sbps)  # gradients of the input


def test_ctc_loss_splits_the_batch():
    """CTC with padded targets and int-list lengths: the batch split (log_probs' dim 1), one device's loss
    and gradient for each reduction; the op itself runs with nothing gathered."""
    torch.manual_seed(9)
    log_probs = torch.randn(6, 5, 4, dtype=F64).log_softmax(2)
    targets = torch.randint(1, 4, (5, 3))
    lengths_in, lengths_t = [6, 5, 6, 4, 6], [3, 2, 1, 3, 2]
    for reduction in REDUCTIONS:
        def fn(lp, t):
            return F.ctc_loss(lp, t, lengths_in, lengths_t, reduction=reduction)
        for mesh, sbp in [(Mesh((4,)), (gt.split(1),)), (Mesh((2,)), (gt.split(1),))]:
            check(fn, [log_probs, targets], mesh, [sbp, (gt.split(0),)])

    def body():
        p = mesh_placement(Mesh((2,)))
        gt.reset_stats()
        lp = gt.to_global(log_probs, p, gt.split(1)).requires_grad_()
        loss = F.ctc_loss(lp, gt.to_global(targets, p, gt.split(0)), lengths_in, lengths_t, reduction="sum")
        loss.backward()
        return gt.stats()["fallback"]
    assert all(not fb for fb in gt.launch(body, 2))


def test_reduced_losses_are_partial_and_read_with_one_scalar():
    """A batch-split 'mean' (or 'sum') loss moves nothing and is P; reading it all-reduces one element."""
    torch.manual_seed(10)
    x, t = torch.randn(8, 4, dtype=F64), torch.randn(8, 4, dtype=F64)
    cls = torch.randint(0, 4, (8,))
    cases = [(lambda a, b: F.huber_loss(a, b), [x, t]), (lambda a, b: F.smooth_l1_loss(a, b, reduction="sum"), [x, t]),
             (lambda a, b: F.multi_margin_loss(a, b), [x, cls]),
             (lambda a, b: F.binary_cross_entropy_with_logits(a, b.sigmoid()), [x, t])]
    for fn, xs in cases:
        want = fn(*xs)

        def body():
            p = mesh_placement(Mesh((4,)))
            gs = [gt.to_global(v, p, gt.split(0)) for v in xs]
            with gt.comm_log() as op_log:
                y = fn(*gs)
            with gt.comm_log() as read_log:
                full = y.full_tensor()
            return y.sbp, [e.kind for e in op_log.events], [(e.kind, e.recv_bytes) for e in read_log.events], full
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = gt.launch(body, 4)
        for rank, (sbp, op_ev, read_ev, full) in enumerate(results):
            torch.testing.assert_close(full, want)
            assert sbp == (gt.partial_sum,) and op_ev == []
            assert read_ev == [("all_reduce", all_reduce_recv_bytes(1, 8, 4, rank))]


@given(meshes([(2,), (4,), (2, 2)]), st.sampled_from(REDUCTIONS), st.booleans(), st.data())
def test_chunked_linear_cross_entropy_splits_the_batch(mesh, reduction, weighted, data):
    """linear_cross_entropy's chunked path (torch_nn custom ops, the gradients computed in the forward for
    'mean'/'sum'): any layout of the input, the linear weight and bias, class weights, an ignored target;
    one device's loss and gradients. 'none' is checked forward only: its backward is Python (not a
    dispatched op) that writes the gradients into plain buffers, whatever the op's layouts."""
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions
    torch.manual_seed(11)
    x, w, b = torch.randn(7, 3, dtype=F64), torch.randn(5, 3, dtype=F64), torch.randn(5, dtype=F64)
    target, cw = torch.tensor([0, 4, 2, 2, 1, 3, 4]), torch.rand(5, dtype=F64) + 0.5
    options = LinearCrossEntropyOptions(batch_chunk_size=2)

    def fn(x, w, b, target, cw):
        return F.linear_cross_entropy(x, w, target.detach(), linear_bias=b, weight=cw.detach() if weighted else None,
                                      ignore_index=2, reduction=reduction, options=options)
    xs = [x, w, b, target, cw]
    sbps = [data.draw(sbps_for(mesh, tuple(t.shape))) for t in xs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(fn, xs, mesh, sbps, grad=reduction != "none")


def test_cross_entropy_on_images_moves_a_count_or_the_target():
    """cross_entropy on [N, C, H, W] split on the batch: 'sum' moves nothing; an unweighted 'mean' divides
    by the scored targets' count, one all-reduce of one element; a weighted 'mean' needs the global total
    weight, from the whole (integer) target: one all-gather of the other ranks' rows of it."""
    torch.manual_seed(12)
    x, t, w = torch.randn(8, 3, 4, 4, dtype=F64), torch.randint(0, 3, (8, 4, 4)), torch.rand(3, dtype=F64)
    rows = 2 * 4 * 4 * 8  # one rank's target rows, int64
    cases = [({}, lambda r: [("all_reduce", all_reduce_recv_bytes(1, 8, 4, r))]),
             ({"reduction": "sum"}, lambda r: []),
             ({"weight": w}, lambda r: [("all_gather", 3 * rows)])]
    for kw, expected in cases:
        want = F.cross_entropy(x, t, **kw)

        def body():
            p = mesh_placement(Mesh((4,)))
            gx, gtg = gt.to_global(x, p, gt.split(0)), gt.to_global(t, p, gt.split(0))
            kws = {k: gt.to_global(v, p, gt.broadcast) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            with gt.comm_log() as log:
                y = F.cross_entropy(gx, gtg, **kws)
            return y.sbp, [(e.kind, e.recv_bytes) for e in log.events], y.full_tensor()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = gt.launch(body, 4)
        for rank, (sbp, events, full) in enumerate(results):
            torch.testing.assert_close(full, want)
            assert sbp == (gt.partial_sum,) and events == expected(rank), (kw.keys(), events)
