"""The strided split (`gt.strided(d, groups)`, DTensor's `_StridedShard`): dim d viewed as `groups` contiguous
blocks, each split over one mesh axis. Its shards, its boxing to and from every other SBP (values, and the
bytes: those of the same conversion on the unflattened tensor, which meet the lower bound), the ops it passes
through for free (a packed gate/up projection: linear, bmm, `_grouped_mm`, chunk, pointwise, the backward's
cat) against one device, from_local/full_tensor and DCP checkpoints."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor import checkpoint as gtc
from globaltensor.sbp import strided_ranges

MESHES = ([0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [[0, 1], [2, 3]])


def _expected(full: torch.Tensor, layout: gt.Layout, rank: int) -> torch.Tensor | None:
    """The shard predicted without the library's arithmetic: numpy.array_split of each block for the strided
    axis, of the piece for a split axis."""
    p = layout.placement
    coord = p.coord(rank)
    if coord is None:
        return None
    out = full.numpy()
    for axis, s in enumerate(layout.sbp):
        if isinstance(s, gt.Split):
            out = np.array_split(out, p.shape[axis], axis=s.dim)[coord[axis]]
        elif isinstance(s, gt.Strided):
            out = np.concatenate([np.array_split(b, p.shape[axis], axis=s.dim)[coord[axis]]
                                  for b in np.split(out, s.groups, axis=s.dim)], axis=s.dim)
    return torch.from_numpy(np.ascontiguousarray(out))


@st.composite
def strided_cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    groups = draw(st.integers(2, 3))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    shape[dim] = groups * draw(st.integers(0, 5))  # even and uneven blocks, empty pieces
    p = gt.placement("cpu", mesh)
    axis = draw(st.integers(0, p.ndim - 1))
    others = [gt.broadcast] + [gt.split(d) for d in range(ndim) if d != dim]
    sbp = tuple(gt.strided(dim, groups) if a == axis else draw(st.sampled_from(others)) for a in range(p.ndim))
    targets = [gt.broadcast, gt.partial_sum] + [gt.split(d) for d in range(ndim)] + [
        gt.strided(dim, g) for g in (2, 3) if shape[dim] % g == 0]
    target = tuple(draw(st.sampled_from(targets)) if a == axis else s for a, s in enumerate(sbp))
    if p.ndim > 1 and draw(st.booleans()):  # the other axis changes too
        target = tuple(draw(st.sampled_from([gt.broadcast, gt.partial_sum])) if a != axis else s
                       for a, s in enumerate(target))
    return tuple(shape), p, sbp, target


@given(strided_cases())
def test_strided_boxes_to_every_sbp_and_back(case):
    """Shards are each block's array_split piece (even and uneven); boxing to any other layout and back gives
    the tensor; where neither end is Partial the bytes are the lower bound, and to Broadcast they are a split's
    all-gather of the same elements."""
    shape, p, sbp, target = case
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    src, dst = gt.Layout(p, sbp), gt.Layout(p, target)

    def body():
        x = gt.to_global(full, p, sbp)
        want = _expected(full, x.global_layout, gt.rank())
        assert torch.equal(x.to_local(), want)
        assert tuple(x.to_local().shape) == src.local_shape(shape, gt.rank())
        y = x.to_global(p, target)
        z = y.to_global(p, sbp)
        assert torch.equal(y.full_tensor(), full) and torch.equal(z.to_local(), want)
        return True

    assert all(gt.launch(body, p.size))
    route = gt.boxing.route(src, dst, shape, torch.float64)
    if not src.has_partial and not dst.has_partial:
        assert sum(route.recv_bytes) == sum(route.lower_bound), route.explain()


def test_strided_pieces_and_normalisation():
    assert gt.strided(1, 1) == gt.split(1) and isinstance(gt.strided(1, 2), gt.Strided)
    assert repr(gt.strided(1, 2)) == "S(1, groups=2)" and gt.strided(1, 2) != gt.split(1)
    assert not isinstance(gt.strided(1, 2), gt.Split)  # rules that take Split(d).dim never see it
    assert strided_ranges(12, 2, 2, 1) == ((3, 3), (9, 3))
    p = gt.placement("cpu", [0, 1])
    layout = gt.Layout(p, gt.strided(0, 2))
    assert layout.ranges((6,), 0) == (((0, 2), (3, 2)),) and layout.local_shape((6,), 1) == (2,)
    assert layout.local_shapes((6,)) == ((4,), (2,))  # uneven: blocks of 3 cut 2 + 1
    with pytest.raises(ValueError, match="groups must be an int >= 2"):
        gt.Strided(0, 1)
    with pytest.raises(ValueError, match="does not divide"):
        layout.check_shape((5,))
    with pytest.raises(ValueError, match="cuts dim 0 on mesh axis 0 as well"):
        gt.Layout(gt.placement("cpu", [[0, 1], [2, 3]]), (gt.split(0), gt.strided(0, 2)))
    with pytest.raises(TypeError, match="one range per block"):
        layout.shard((6,), 0)


def test_from_local_and_full_tensor():
    full = torch.arange(24.0).reshape(2, 12)
    p = gt.placement("cpu", [0, 1])

    def body():
        r = gt.rank()
        local = torch.cat([full[:, 3 * r:3 * r + 3], full[:, 6 + 3 * r:9 + 3 * r]], 1)
        x = gt.from_local(local, p, gt.strided(1, 2))
        assert tuple(x.shape) == (2, 12) and isinstance(x, gt.StridedTensor)
        assert torch.equal(x.full_tensor(), full) and torch.equal(x.to_local(), local)
        return True
    assert all(gt.launch(body, 2))


def _mlp(x, w, reduce=True):
    """A gated MLP as transformers writes it: one packed projection, chunked into gate and up."""
    gate, up = (x @ w.t()).chunk(2, -1)
    h = F.silu(gate) * up
    return h.sum() if reduce else h


@given(st.sampled_from(MESHES[1:]), st.integers(1, 3), st.integers(1, 4), st.integers(1, 6))
def test_gated_projection_moves_nothing_and_equals_one_device(mesh, rows, hidden, width):
    """`(x @ w.T).chunk(2, -1)` with w strided: gate and up come out split on their own width, the product and
    its gradient too, and the backward's `cat` gives w's gradient strided: where the width divides by the
    tensor axis nothing but the loss's and x's gradient's reductions moves on it; values and gradients equal
    one device, uneven widths too (the product then boxes w to a contiguous split first)."""
    p = gt.placement("cpu", mesh)
    n = p.shape[-1]
    even = width % n == 0
    torch.manual_seed(rows * 100 + hidden * 10 + width)
    X, W = torch.randn(rows * 2, hidden, dtype=torch.float64), torch.randn(2 * width, hidden, dtype=torch.float64)
    X.requires_grad_()
    W.requires_grad_()
    want = _mlp(X, W)
    want.backward()
    tensor = tuple(gt.broadcast for _ in range(p.ndim - 1))
    data = tuple(gt.split(0) for _ in range(p.ndim - 1))

    def body():
        x = gt.to_global(X.detach(), p, data + (gt.broadcast,)).requires_grad_()
        w = gt.to_global(W.detach(), p, tensor + (gt.strided(0, 2),)).requires_grad_()
        with gt.comm_log() as log:
            h = _mlp(x, w, reduce=False)
            loss = h.sum()
            loss.backward()
        if even:
            assert h.sbp[-1] == gt.split(1)
            assert isinstance(w.grad, gt.StridedTensor) and w.grad.sbp[-1] == gt.strided(0, 2)
            tensor_axis = [e for e in log.events if len(e.group) == n and e.group in p.axis_groups(p.ndim - 1)]
            # on the tensor axis: the loss's reduction and x's gradient's only (no recut of gate/up)
            assert all(e.kind in ("all_reduce", "reduce_scatter") for e in tensor_axis), tensor_axis
        torch.testing.assert_close(loss.full_tensor(), want.detach())
        torch.testing.assert_close(w.grad.full_tensor(), W.grad)
        torch.testing.assert_close(x.grad.full_tensor(), X.grad)
        return True
    assert all(gt.launch(body, p.size))


def test_bmm_and_grouped_mm_keep_the_strided_dim():
    """bmm with the weight strided on its output dim, and `_grouped_mm` (transformers' grouped experts, forward and
    the weight gradient it computes [k,M]@[M,n]) give the output strided on its last dim; equal to one device."""
    torch.manual_seed(0)
    E, M, H, I2 = 3, 7, 4, 8
    A = torch.randn(E, 5, H, requires_grad=True)
    Wb = torch.randn(E, H, I2, requires_grad=True)
    X = torch.randn(M, H, requires_grad=True)
    Wg = torch.randn(E, I2, H, requires_grad=True)
    offs = torch.tensor([2, 5, 7], dtype=torch.int32)

    def f(a, wb, x, wg):
        y1 = torch.bmm(a, wb)
        y2 = torch._grouped_mm(x, wg.transpose(-2, -1), offs=offs)
        g1, u1 = y1.chunk(2, -1)
        g2, u2 = y2.chunk(2, -1)
        return (g1 * u1).sum() + (F.silu(g2) * u2).sum(), y1, y2
    want, _, _ = f(A, Wb, X, Wg)
    want.backward()
    p = gt.placement("cpu", [0, 1])

    def body():
        a, x = (gt.to_global(t.detach(), p, gt.broadcast).requires_grad_() for t in (A, X))
        wb = gt.to_global(Wb.detach(), p, gt.strided(2, 2)).requires_grad_()
        wg = gt.to_global(Wg.detach(), p, gt.strided(1, 2)).requires_grad_()
        with gt.comm_log() as log:
            loss, y1, y2 = f(a, wb, x, wg)
            assert y1.sbp == (gt.strided(2, 2),) and y2.sbp == (gt.strided(1, 2),)
            loss.backward()
        assert wb.grad.sbp == (gt.strided(2, 2),) and wg.grad.sbp == (gt.strided(1, 2),)
        assert all(e.kind in ("all_reduce",) for e in log.events), log.events
        torch.testing.assert_close(loss.full_tensor(), want.detach())
        for g, w in ((a.grad, A), (x.grad, X), (wb.grad, Wb), (wg.grad, Wg)):
            torch.testing.assert_close(g.full_tensor(), w.grad)
        return True
    assert all(gt.launch(body, 2))


def test_other_ops_box_to_a_split_first():
    """An op the strided reading does not cover (cumsum along the dim) sees a contiguous split: correct."""
    full = torch.arange(12.0)
    p = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(full, p, gt.strided(0, 2))
        assert torch.equal(x.cumsum(0).full_tensor(), full.cumsum(0))
        assert torch.equal(x[1:5].full_tensor(), full[1:5])
        with pytest.raises(NotImplementedError, match="in place"):
            x.cumsum_(0)
        with gt.comm_log() as log:  # the values are not read: nothing moves
            zeros = x.new_zeros(3, 4)
        assert log.recv_bytes == 0 and torch.equal(zeros.full_tensor(), torch.zeros(3, 4))
        return True
    assert all(gt.launch(body, 2))


@given(st.sampled_from([([0, 1], 0), ([0, 1, 2], 0), ([[0, 1], [2, 3]], 1)]), st.integers(1, 5),
       st.sampled_from(["split", "broadcast", "strided3"]))
def test_checkpoint_of_a_strided_tensor_loads_into_other_layouts(tmp_path_factory, mesh_axis, block, other):
    """Saved strided (each rank writes one chunk per block), loaded into a split, a broadcast or another strided
    split, and back: bitwise."""
    mesh, axis = mesh_axis
    path = str(tmp_path_factory.mktemp("ckpt"))
    p = gt.placement("cpu", mesh)
    full = torch.arange(6.0 * block * 3).reshape(6 * block, 3)
    sbp = tuple(gt.strided(0, 2) if a == axis else gt.broadcast for a in range(p.ndim))
    to = {"split": gt.split(0), "broadcast": gt.broadcast, "strided3": gt.strided(0, 3)}[other]
    sbp2 = tuple(to if a == axis else gt.split(1) for a in range(p.ndim))

    def body():
        gtc.save({"t": gt.to_global(full, p, sbp)}, path + "/a")
        y = gt.to_global(torch.zeros_like(full), p, sbp2)
        gtc.load({"t": y}, path + "/a")
        assert torch.equal(y.full_tensor(), full)
        gtc.save({"t": y}, path + "/b")
        z = gt.to_global(torch.zeros_like(full), p, sbp)
        gtc.load({"t": z}, path + "/b")
        assert torch.equal(z.to_local(), _expected(full, z.global_layout, gt.rank()))
        return True
    assert all(gt.launch(body, p.size))
    md = gtc.read_metadata(path + "/a")
    chunks = md.state_dict_metadata["t"].chunks
    assert sum(math.prod(c.sizes) for c in chunks) == full.numel()
    assert len(chunks) == 2 * p.shape[axis]  # a chunk per block per rank of the strided axis


def test_checkpoint_chunks_follow_ranges_so_a_zigzag_tensor_saves_too(tmp_path):
    """DCP's chunks are a rank's ranges (chunks.py), not its box: a zigzag shard is its two chunks, and loads
    into a split and back into a zigzag bitwise."""
    full = torch.arange(30.0).reshape(10, 3)
    p = gt.placement("cpu", [0, 1])

    def body():
        gtc.save({"t": gt.to_global(full, p, gt.zigzag(0))}, str(tmp_path))
        y = gt.to_global(torch.zeros_like(full), p, gt.split(1))
        gtc.load({"t": y}, str(tmp_path))
        z = gt.to_global(torch.zeros_like(full), p, gt.zigzag(0))
        gtc.load({"t": z}, str(tmp_path))
        return torch.equal(y.full_tensor(), full) and torch.equal(z.full_tensor(), full)
    assert all(gt.launch(body, 2))
    assert len(gtc.read_metadata(tmp_path).state_dict_metadata["t"].chunks) == 4


def test_in_place_on_the_reading_and_refused_off_it():
    """An in-place pointwise op writes the strided shard itself (AdamW's updates of a strided parameter); one whose
    other operand is strided otherwise (another groups count) still lands in the shard; one whose shard would be
    a copy is refused, naming the fix."""
    full = torch.arange(12.0)
    p = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(full.clone(), p, gt.strided(0, 2))
        x.mul_(2).add_(gt.to_global(full, p, gt.strided(0, 3)))
        assert x.sbp == (gt.strided(0, 2),) and torch.equal(x.full_tensor(), 3 * full)
        x.add_(gt.to_global(full, p, gt.split(0)))
        assert torch.equal(x.full_tensor(), 4 * full)
        return True
    assert all(gt.launch(body, 2))


def test_expert_selection_keeps_the_strided_dim():
    """transformers' eager experts: `w[e]` of a strided [E, 2I, H] weight (index.Tensor with a 0-dim index, and
    select) is strided [2I, H]; its gradient (index_put into zeros, select_backward) strided again: the loop
    over experts moves only the reductions of x's gradient and the loss; equal to one device."""
    torch.manual_seed(1)
    E, I, H, T = 3, 4, 5, 6
    W = torch.randn(E, 2 * I, H, dtype=torch.float64, requires_grad=True)
    X = torch.randn(T, H, dtype=torch.float64, requires_grad=True)

    def f(x, w, index):
        total = 0
        for e in range(E):
            we = w[index(e)] if e != 1 else w[e]  # a 0-dim index tensor, and a select
            total = total + _mlp(x[e:e + 3], we)
        return total
    want = f(X, W, lambda e: torch.tensor(e))
    want.backward()
    p = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(X.detach(), p, gt.broadcast).requires_grad_()
        w = gt.to_global(W.detach(), p, gt.strided(1, 2)).requires_grad_()
        with gt.comm_log() as log:
            loss = f(x, w, lambda e: gt.to_global(torch.tensor(e), p, gt.broadcast))
            loss.backward()
        assert w.grad.sbp == (gt.strided(1, 2),)
        assert {e.kind for e in log.events} <= {"all_reduce", "reduce_scatter"}, log.events  # the loss, x.grad
        torch.testing.assert_close(loss.full_tensor(), want.detach())
        torch.testing.assert_close(w.grad.full_tensor(), W.grad)
        torch.testing.assert_close(x.grad.full_tensor(), X.grad)
        return True
    assert all(gt.launch(body, 2))


def test_linear_with_a_strided_bias_on_3d_input():
    """`F.linear(x, w, b)` on [batch, seq, hidden] with w and its bias strided (a packed Linear's "packed_colwise"):
    addmm takes the weight as its reference (the bias is broadcast over the rows), the result is strided on its
    last dim, and nothing moves, forward or backward; equal to one device."""
    torch.manual_seed(2)
    W, b, X = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((8, 5), (8,), (2, 3, 5)))

    def f(x, w, bias):
        g, u = F.linear(x, w, bias).chunk(2, -1)
        return (F.gelu(g) * u).sum()
    want = f(X, W, b)
    want.backward()
    p = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(X.detach(), p, gt.broadcast).requires_grad_()
        w, bias = (gt.to_global(t.detach(), p, gt.strided(0, 2)).requires_grad_() for t in (W, b))
        with gt.comm_log() as log:
            assert F.linear(x, w, bias).sbp == (gt.strided(2, 2),)
            loss = f(x, w, bias)
            loss.backward()
        assert {e.kind for e in log.events} <= {"all_reduce"}, log.events  # x's gradient, the loss
        torch.testing.assert_close(loss.full_tensor(), want.detach())
        for got, ref in ((w.grad, W), (bias.grad, b), (x.grad, X)):
            torch.testing.assert_close(got.full_tensor(), ref.grad)
        return True
    assert all(gt.launch(body, 2))


def test_torch_save_and_load_keep_the_strided_tensor(tmp_path):
    full = torch.arange(12.0).reshape(6, 2)
    p = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(full, p, gt.strided(0, 3))
        path = tmp_path / f"x{gt.rank()}.pt"
        torch.save(x, path)
        y = torch.load(path, weights_only=True)
        return isinstance(y, gt.StridedTensor) and y.sbp == x.sbp and torch.equal(y.full_tensor(), full)
    assert all(gt.launch(body, 2))
