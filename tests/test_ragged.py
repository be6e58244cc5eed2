"""Ragged splits (`gt.ragged(dim)`, sizes carried by the tensor): conversions equal one device and move
exactly the rows that change hands (one uneven all-to-all, forward and backward); pointwise ops and sums
and every op whose rule passes a split of the ragged dim through (it works along other dims) keep the
sizes, with no data moved; every other op refuses, naming itself and the input; bad sizes are named."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt

TOL = dict(rtol=1e-12, atol=1e-12)


def launch(fn, n, *args):
    return gt.launch(fn, n, args=args, backend="sim")


def _mesh(shape):
    return gt.placement("cpu", np.arange(int(np.prod(shape))).reshape(shape).tolist())


def _balanced(n, parts):
    return [len(a) for a in np.array_split(np.arange(n), parts)]


def _moved(src, dst, me, row_bytes):
    """Bytes member `me` receives re-cutting `src` sizes into `dst` ones: its target rows it did not hold."""
    s, d = np.cumsum([0] + list(src)), np.cumsum([0] + list(dst))
    held = max(0, min(s[me + 1], d[me + 1]) - max(s[me], d[me]))
    return (dst[me] - held) * row_bytes


def _recut_step(full, mesh, axis, other, sizes, target, target_sizes):
    """full laid out ragged on `axis` (`other` on the other axis), converted to `target`; values, bytes, grad."""
    p = _mesh(mesh)
    sbp = tuple(gt.ragged(0) if a == axis else other for a in range(len(mesh)))
    x = gt.to_global(full, p, sbp, sizes=sizes).requires_grad_(True)
    dst = tuple(target if a == axis else other for a in range(len(mesh)))
    with gt.comm_log() as fwd:
        y = gt.to_global(x, p, dst, sizes=target_sizes)
    w = torch.arange(full.numel(), dtype=full.dtype).reshape(full.shape) + 1
    loss = (y * gt.to_global(w, p, dst, sizes=target_sizes)).sum()  # its gradient arrives as y is laid out
    with gt.comm_log() as bwd:
        loss.backward()
    return (y.full_tensor(), tuple(y.to_local().shape), [e.recv_bytes for e in fwd.events if e.kind == "all_to_all"],
            [e.recv_bytes for e in bwd.events if e.kind == "all_to_all"], x.grad.full_tensor(),
            type(x.grad).__name__, getattr(x.grad, "sizes", None))


@settings(max_examples=max(25, settings.default.max_examples * 25 // 18), deadline=None)   # 25 in CI, more in dev
@given(mesh=st.sampled_from([(2,), (3,), (4,), (2, 2)]), rows=st.integers(0, 11), cols=st.integers(1, 3),
       data=st.data())
def test_recut_equals_one_device_at_exact_bytes(mesh, rows, cols, data):
    """ragged -> balanced and ragged -> ragged: the value is kept, each rank receives exactly the rows its
    target range holds and its source range did not, forward; the backward re-cuts the gradient back."""
    axis = data.draw(st.integers(0, len(mesh) - 1))
    n = mesh[axis]
    cut = lambda: data.draw(st.lists(st.integers(0, rows), min_size=n - 1, max_size=n - 1).map(sorted))  # noqa: E731
    sizes = list(np.diff([0] + cut() + [rows]))
    to_ragged = data.draw(st.booleans())
    target_sizes = [int(v) for v in np.diff([0] + cut() + [rows])] if to_ragged else None
    other = data.draw(st.sampled_from([gt.broadcast, gt.split(1)]))
    full = torch.randn(rows, cols, dtype=torch.float64)
    target = gt.ragged(0) if to_ragged else gt.split(0)
    results = launch(_recut_step, int(np.prod(mesh)), full, mesh, axis, other, [int(v) for v in sizes], target,
                     target_sizes)
    dst = target_sizes or _balanced(rows, n)
    w = torch.arange(full.numel(), dtype=full.dtype).reshape(full.shape) + 1
    for rank, (y, local, fwd, bwd, grad, kind, grad_sizes) in enumerate(results):
        torch.testing.assert_close(y, full, **TOL)
        torch.testing.assert_close(grad, w, **TOL)
        coord = np.argwhere(np.arange(int(np.prod(mesh))).reshape(mesh) == rank)[0]
        me = coord[axis]
        row_cols = cols if other == gt.broadcast or len(mesh) == 1 else _balanced(cols, mesh[1 - axis])[coord[1 - axis]]
        assert local[0] == dst[me]
        if rows:  # (an empty tensor's gradient is autograd's zeros, not converted)
            assert kind == "RaggedTensor" and grad_sizes[axis] == tuple(sizes)
        if n > 1 and dst != sizes:
            assert fwd == [_moved(sizes, dst, me, row_cols * 8)], (rank, fwd)
            assert bwd == [_moved(dst, sizes, me, row_cols * 8)], (rank, bwd)


def _ops_step(full, sizes, bias):
    p = _mesh((len(sizes),))
    x = gt.to_global(full, p, gt.ragged(0), sizes=sizes).requires_grad_(True)
    b = gt.to_global(bias, p, gt.broadcast).requires_grad_(True)
    y = torch.nn.functional.gelu(x * 2.0 + b).tanh()
    rowsum = y.sum(1)                  # keeps the ragged dim: still ragged
    total = (rowsum * rowsum).sum()    # over the ragged dim: Partial, reduced where read
    with gt.comm_log() as log:
        total.backward()
    return (type(y).__name__, y.sizes, type(rowsum).__name__, tuple(total.sbp), total.full_tensor(),
            x.grad.full_tensor(), b.grad.full_tensor(), [e.kind for e in log.events])


def test_pointwise_and_sums_pass_sizes_through():
    """Pointwise ops keep layout and sizes (a Broadcast operand is sliced locally), a sum over another dim
    stays ragged, a sum over the ragged dim is Partial; values and gradients equal one device."""
    torch.manual_seed(0)
    sizes = [4, 0, 3]
    full, bias = torch.randn(7, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    x, b = full.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    rowsum = torch.nn.functional.gelu(x * 2.0 + b).tanh().sum(1)
    total = (rowsum * rowsum).sum()
    total.backward()
    for kind, sz, kind_sum, sbp, t, xg, bg, events in launch(_ops_step, 3, full, sizes, bias):
        assert kind == kind_sum == "RaggedTensor" and sz == (tuple(sizes),)
        assert sbp == (gt.partial_sum,)
        torch.testing.assert_close(t, total.detach(), **TOL)
        torch.testing.assert_close(xg, x.grad, **TOL)
        torch.testing.assert_close(bg, b.grad, **TOL)
        assert "all_to_all" not in events  # the gradient keeps the sizes: nothing re-cut


def _routing(x, k):
    """A router's ops along the dims other than x's first: softmax and topk over the last, one_hot, a
    cumsum and a stable argsort along dim 1, a sum over the last, a batched product with dim 0 as the batch."""
    probs = x.softmax(-1)
    top_p, top_i = probs.topk(k, dim=-1)
    masks = torch.nn.functional.one_hot(top_i, x.shape[-1])
    pos = masks.reshape(x.shape[0], -1, x.shape[-1]).cumsum(1)
    order = top_i.reshape(x.shape[0], -1).argsort(dim=1, stable=True)
    mixed = torch.bmm(probs, probs.transpose(1, 2)) * top_p.sum(-1, keepdim=True)
    return probs, top_i, masks, pos, order, mixed


def _through_step(full, mesh, sizes, k):
    """`_routing` on x ragged on dim 0 (the user's sizes, or, sizes None, a reshape of an uneven batch
    split: two groups per sequence, nested on 2x2); every output's type, layout and sizes, the values,
    the collectives, and the gradient."""
    p = _mesh(mesh)
    if sizes is None:
        seqs = gt.to_global(full.reshape(-1, 2 * full.shape[1], full.shape[2]), p, (gt.split(0),) * len(mesh))
        x = seqs.requires_grad_(True)
        rows = x.reshape(full.shape)
    else:
        x = rows = gt.to_global(full, p, gt.ragged(0), sizes=sizes).requires_grad_(True)
    with gt.comm_log() as log:
        outs = _routing(rows, k)
        (outs[0] * outs[5]).sum().backward()
    return ([(type(o).__name__, o.sbp, getattr(o, "sizes", None)) for o in outs], rows.sbp, rows.sizes,
            [o.full_tensor() for o in outs], [e.kind for e in log.events if e.kind != "all_reduce"],
            x.grad.full_tensor())


@pytest.mark.parametrize("mesh, sizes, groups", [((3,), [3, 0, 2], 5), ((2,), None, 6), ((4,), None, 6),
                                                 ((2, 2), None, 10)])
@pytest.mark.parametrize("k", [1, 2])
def test_ops_along_other_dims_keep_a_ragged_split(mesh, sizes, groups, k):
    """The general rule: an op whose rule lets a split of the ragged dim pass through (the output split on
    a dim as long as it) keeps the ragged split and its sizes, with no data moved: softmax and topk over
    the last dim, one_hot, cumsum and argsort along dim 1, sums over other dims, bmm with the ragged dim
    as the batch, forward and backward. Sizes given by the user ([3, 0, 2]: a rank with none) or made by
    a reshape of an uneven batch split (3 sequences of two groups on 2 ranks: 4 + 2 groups; 5 on 2x2:
    nested runs). No collective but the final sum's (a Partial scalar reduced); values equal one device."""
    torch.manual_seed(k)
    full = torch.randn(groups, 4, 4, dtype=torch.float64)
    x = full.clone().requires_grad_(True)
    want = _routing(x, k)
    (want[0] * want[5]).sum().backward()
    for layouts, sbp, got_sizes, outs, kinds, xg in launch(_through_step, int(np.prod(mesh)), full, mesh, sizes, k):
        assert kinds == [], kinds
        for kind, out_sbp, out_sizes in layouts:
            assert kind == "RaggedTensor" and out_sbp == sbp and out_sizes == got_sizes, (kind, out_sbp, sbp)
        for got, ref in zip(outs, want):
            if ref.is_floating_point():
                torch.testing.assert_close(got, ref.detach(), **TOL)
            else:
                assert torch.equal(got, ref)
        torch.testing.assert_close(xg.reshape(x.shape), x.grad, **TOL)


def _decided_step():
    from globaltensor.ops import dispatch
    p = _mesh((2,))
    x = gt.from_local(torch.ones(gt.rank() + 1, 3), p, gt.ragged(0), sizes=[1, 2])
    dec = dispatch.decision_of(torch.ops.aten._softmax.default, (x, 1, False), {}, gt.GlobalTensor)
    again = dispatch.decision_of(torch.ops.aten._softmax.default, (x, 1, False), {}, gt.GlobalTensor)
    return dec.kind, dec.sources[0].sbp, dec.out_layouts[0].sbp, dec.rows.axes, again is dec


def test_a_ragged_call_is_decided_by_the_one_dispatcher():
    """The general rule's decision is the dispatcher's, on the balanced stand-in, from its one cache."""
    for kind, src, out, axes, cached in launch(_decided_step, 2):
        assert (kind, src, out, axes, cached) == ("kernel", (gt.split(0),), (gt.split(0),), (0,), True)


def _refuse_step(op):
    p = _mesh((2,))
    x = gt.from_local(torch.ones(gt.rank() + 1, 3), p, gt.ragged(0), sizes=[1, 2])
    w = gt.to_global(torch.ones(3, 3), p, gt.broadcast)
    try:
        {"flip": lambda: x.flip(0) @ w, "cumsum": lambda: x.cumsum(0), "softmax": lambda: x.softmax(0),
         "cat": lambda: torch.cat([x, x]), "view": lambda: x.reshape(-1)}[op]()
    except NotImplementedError as e:
        return str(e)
    return None


@pytest.mark.parametrize("op", ["flip", "cumsum", "softmax", "cat", "view"])
def test_other_ops_refuse_a_ragged_input_by_name(op):
    """Ops along the ragged dim (flip, a scan, softmax over it, cat along it) or merging it (view) refuse,
    naming the op and the input (`x @ w` of ragged rows is taken: test_ops_along_other_dims_keep_a_ragged_split)."""
    for msg in launch(_refuse_step, 2, op):
        assert msg is not None and "ragged" in msg and "input 0" in msg and "R(0)" in msg, msg
        assert "aten." in msg


def _bad_sizes_step(case):
    p = _mesh((2,))
    r = gt.rank()
    if case == "sum":       # rank 1 holds 3 rows but sizes give it 2
        return gt.from_local(torch.ones(r + 2, 3), p, gt.ragged(0), sizes=[2, 2])
    if case == "differ":    # the ranks' views of the sizes disagree
        return gt.from_local(torch.ones(2, 3), p, gt.ragged(0), sizes=[2, 2] if r == 0 else [1, 3])
    if case == "shape":     # sizes do not add up to the given global dim
        return gt.from_local(torch.ones(2, 3), p, gt.ragged(0), sizes=[2, 2], shape=(5, 3))
    if case == "count":     # one size per rank of the axis
        return gt.from_local(torch.ones(2, 3), p, gt.ragged(0), sizes=[2, 2, 0])
    if case == "missing":
        return gt.from_local(torch.ones(2, 3), p, gt.ragged(0))
    if case == "to_global":
        return gt.to_global(torch.ones(4, 3), p, gt.ragged(0), sizes=[1, 2])
    if case == "no_sizes":
        return gt.to_global(gt.to_global(torch.ones(4, 3), p, gt.split(0)), p, gt.ragged(0))


@pytest.mark.parametrize("case", ["sum", "differ", "shape", "count", "missing", "to_global"])
def test_bad_sizes_are_named(case):
    with pytest.raises(ValueError, match=r"sizes"):
        launch(_bad_sizes_step, 2, case)


def test_a_ragged_target_without_sizes_is_named():
    with pytest.raises(ValueError, match=r"sizes"):
        launch(_bad_sizes_step, 2, "no_sizes")


def _grouped_step(case):
    p = _mesh((2, 2))
    ids = gt.to_global(torch.arange(24).reshape(4, 6) % 4, p, (gt.split(0), gt.split(0)))
    counts = torch.nn.functional.one_hot(ids, 4).sum(1)
    xs = gt.to_global(torch.randn(4, 6, 3, dtype=torch.float64), p, (gt.split(0), gt.split(0)))
    w = gt.to_global(torch.randn(4, 3, 2, dtype=torch.float64), p, (gt.broadcast, gt.split(0)))
    if case == "counts":   # a group's counts must add up to its rows
        return gt.by_expert(xs, counts * 2, w)
    rows, _ = gt.by_expert(xs, counts, w)
    if case == "slice":    # EP x DP: the rows are ragged per data slice, sizes known inside it only
        return rows.full_tensor()


@pytest.mark.parametrize("case, match", [("counts", "by_expert\\(counts\\)"), ("slice", "by_group")])
def test_grouped_ops_name_what_is_wrong(case, match):
    with pytest.raises(ValueError, match=match):
        launch(_grouped_step, 4, case)


def _indexed_step(tokens, index, counts, back, w, gy, mesh, indexed):
    """by_expert / by_group on 2 ranks (groups and experts split), with the index folded in or as gathers."""
    p = _mesh(mesh)
    x = gt.to_global(tokens, p, gt.split(0)).requires_grad_(True)
    gi, gc, gb = (gt.to_global(t, p, gt.split(0)) for t in (index, counts, back))
    gw = gt.to_global(w, p, gt.split(0))
    d = tokens.shape[-1]
    with gt.comm_log() as log:
        if indexed:
            rows, routing = gt.by_expert(x, gc, gw, gi)
            y = gt.by_group(rows * 3.0, routing, gb)
        else:
            rows, routing = gt.by_expert(x.gather(1, gi.unsqueeze(-1).expand(-1, -1, d)), gc, gw)
            y = gt.by_group(rows * 3.0, routing).gather(1, gb.unsqueeze(-1).expand(-1, -1, d))
        (y * gt.to_global(gy, p, gt.split(0))).sum().backward()
    return y.full_tensor(), x.grad.full_tensor(), [(e.kind, e.recv_bytes) for e in log.events if e.kind == "all_to_all"]


@settings(max_examples=max(10, settings.default.max_examples * 5 // 9), deadline=None)   # 10 in CI, more in dev
@given(k=st.integers(1, 3), seed=st.integers(0, 99))
def test_by_expert_and_by_group_fold_an_index(k, seed):
    """`by_expert(xs, counts, w, index)` is `by_expert(xs.gather(1, index), ...)` and `by_group(y, routing, back)`
    is `by_group(y, routing).gather(1, back)`, on one device and on 2 ranks, values and gradients; folded,
    the all-to-alls move the same bytes (the gather and its scatter happen on each rank's own rows)."""
    g, s, d, e = 4, 5, 3, 4
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(g, s, d, dtype=torch.float64, generator=gen)
    ids = torch.randint(0, e, (g, s * k), generator=gen)
    order = ids.argsort(dim=1, stable=True)
    index, back = order // k, order.argsort(1)
    counts = torch.nn.functional.one_hot(ids, e).sum(1)
    w = torch.randn(e, d, 2, dtype=torch.float64, generator=gen)
    gy = torch.randn(g, s * k, d, dtype=torch.float64, generator=gen)
    x = tokens.clone().requires_grad_(True)
    rows, routing = gt.by_expert(x, counts, w, index)
    y = gt.by_group(rows * 3.0, routing, back)
    (y * gy).sum().backward()
    want = tokens.repeat_interleave(k, dim=1) * 3.0    # every choice back in choice order, times 3
    torch.testing.assert_close(y.detach(), want, **TOL)
    torch.testing.assert_close(x.grad, gy.reshape(g, s, k, d).sum(2) * 3.0, **TOL)
    folded = launch(_indexed_step, 2, tokens, index, counts, back, w, gy, (2,), True)
    gathered = launch(_indexed_step, 2, tokens, index, counts, back, w, gy, (2,), False)
    for (yf, gf, bf), (yg, gg, bg) in zip(folded, gathered):
        torch.testing.assert_close(yf, want, **TOL)
        torch.testing.assert_close(yg, want, **TOL)
        torch.testing.assert_close(gf, x.grad, **TOL)
        torch.testing.assert_close(gg, x.grad, **TOL)
        assert bf == bg and len(bf) == 4


def _bad_index_step(case):
    p = _mesh((2,))
    counts = gt.to_global(torch.tensor([[2, 2], [4, 0]]), p, gt.split(0))
    xs = gt.to_global(torch.randn(2, 3, 2, dtype=torch.float64), p, gt.split(0))
    w = gt.to_global(torch.randn(2, 2, 2, dtype=torch.float64), p, gt.split(0))
    if case == "range":     # a token index past the group's 3 tokens
        return gt.by_expert(xs, counts, w, gt.to_global(torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]]), p, gt.split(0)))
    if case == "float":
        return gt.by_expert(xs, counts, w, gt.to_global(torch.zeros(2, 4), p, gt.split(0)))
    rows, routing = gt.by_expert(xs, counts, w, gt.to_global(torch.tensor([[0, 1, 2, 2], [0, 0, 1, 1]]), p,
                                                             gt.split(0)))
    return gt.by_group(rows, routing, gt.to_global(torch.tensor([[0, 4], [1, 2]]), p, gt.split(0)))


@pytest.mark.parametrize("case, match", [("range", r"by_expert\(index\).*\[0, 3\)"), ("float", r"by_expert\(index\)"),
                                         ("back", r"by_group\(index\).*\[0, 4\)")])
def test_a_bad_index_is_named(case, match):
    with pytest.raises(ValueError, match=match):
        launch(_bad_index_step, 2, case)
