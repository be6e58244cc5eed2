"""The zigzag layout (`gt.zigzag(d)`): rank i of n holds chunks i and 2n-1-i of 2n.

Its shards are those of one device's tensor cut by hand; conversions to and from contiguous splits
and Broadcast keep the values and receive exactly the route's bytes, which meet the lower bound;
ops that do not depend on the order of d keep the zigzag, the others get a contiguous split first;
bad layouts are refused naming the sbp. (Attention on zigzag inputs: tests/test_ring_attention.py.)
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.sbp import split_sizes, zigzag_ranges
from ops_support import mesh_placement

D = torch.float64


def _by_hand(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    return torch.cat([t.narrow(dim, a, n) for a, n in zigzag_ranges(t.shape[dim], parts, index)], dim)


def test_chunks_cover_the_dim_once_in_split_sizes():
    for length in range(0, 13):
        for parts in range(1, 5):
            rows = []
            for i in range(parts):
                (a, n), (b, m) = zigzag_ranges(length, parts, i)
                assert n + m == split_sizes(length, parts)[i] and n >= m and a + n <= b
                rows += list(range(a, a + n)) + list(range(b, b + m))
            assert sorted(rows) == list(range(length))


MESH_CASES = [  # (mesh, zigzag sbp, shape)
    ((2,), (gt.zigzag(0),), (8, 3)),
    ((3,), (gt.zigzag(1),), (2, 7)),                      # uneven: chunks of 2 and 1
    ((2, 2), (gt.split(0), gt.zigzag(1)), (3, 9, 2)),     # another dim split on the other axis
    ((2, 2), (gt.zigzag(1), gt.broadcast), (2, 8)),
    ((2, 2), (gt.split(1), gt.zigzag(1)), (2, 9)),        # axis 0 cuts dim 1 first, each piece zigzag
]

# the conversions each case checks: (target sbp, bytes rank 0 receives from the zigzag, or None)
CONVERSIONS = {
    0: [((gt.split(0),), 2 * 3 * 8), ((gt.broadcast,), 4 * 3 * 8), ((gt.split(1),), 4 * 2 * 8)],
    1: [((gt.split(1),), None), ((gt.broadcast,), None), ((gt.split(0),), None)],
    2: [((gt.split(0), gt.split(1)), None), ((gt.split(0), gt.broadcast), None),
        ((gt.broadcast, gt.zigzag(1)), None), ((gt.split(1), gt.split(0)), None)],
    3: [((gt.split(1), gt.broadcast), None), ((gt.broadcast, gt.broadcast), None),
        ((gt.zigzag(1), gt.split(0)), None), ((gt.split(0), gt.split(1)), None)],
    4: [((gt.split(1), gt.split(1)), None), ((gt.broadcast, gt.broadcast), None),
        ((gt.broadcast, gt.zigzag(1)), None), ((gt.split(0), gt.zigzag(1)), None)],
}


@pytest.mark.parametrize("i", range(len(MESH_CASES)))
def test_shards_conversions_and_bytes(i):
    """Each rank's shard is its two chunks; every conversion both ways keeps the values, moves exactly
    the route's bytes (the lower bound) and, backward, gives the one-device gradient."""
    mesh, sbp, shape = MESH_CASES[i]
    torch.manual_seed(i)
    full = torch.randn(shape, dtype=D)
    zaxis = next(a for a, s in enumerate(sbp) if isinstance(s, gt.Zigzag))
    dim = sbp[zaxis].dim

    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(full, p, sbp)
        coord = p.coord(gt.rank())
        want = full
        for a, s in enumerate(sbp):  # mesh axis 0 cuts first; the zigzag cuts the piece it is left
            if isinstance(s, gt.Split):
                want = torch.tensor_split(want, mesh[a], s.dim)[coord[a]]
            elif a == zaxis:
                want = _by_hand(want, dim, mesh[zaxis], coord[zaxis])
        assert isinstance(x, gt.ZigzagTensor) and torch.equal(x.to_local(), want)
        assert torch.equal(gt.from_local(x.to_local(), p, sbp).full_tensor(), full)
        moved = []
        for target, exact in CONVERSIONS[i]:
            src = gt.to_global(full, p, target)
            for a, b in ((x, target), (src, sbp)):
                route = gt.boxing.route(a.global_layout, gt.Layout(p, b), shape, D)
                with gt.comm_log() as log:
                    y = a.to_global(p, b)
                assert torch.equal(y.full_tensor(), full), (a.sbp, b)
                assert log.recv_bytes == route.recv_bytes_of(gt.rank()), (a.sbp, b, route.explain())
                assert route.recv_bytes == list(route.lower_bound), route.explain()
                if exact is not None and a is x:
                    moved.append(log.recv_bytes)
            # backward: the dual conversion, to the one-device gradient
            leaf = gt.to_global(full, p, sbp).requires_grad_()
            (leaf.to_global(p, target) * 3).sum().backward()
            assert leaf.grad.sbp == sbp and torch.equal(leaf.grad.full_tensor(), torch.full(shape, 3.0, dtype=D))
        return moved
    results = gt.launch(body, math.prod(mesh))
    expected = [e for _, e in CONVERSIONS[i] if e is not None]
    assert results[0] == expected


def test_full_tensor_gradient_is_the_zigzag_slice():
    def body():
        p = gt.placement("cpu", [0, 1])
        w = torch.arange(7.0, dtype=D)
        x = gt.to_global(torch.zeros(7, dtype=D), p, gt.zigzag(0)).requires_grad_()
        (x.full_tensor() * w).sum().backward()
        return x.grad.to_local()
    r0, r1 = gt.launch(body, 2)
    assert r0.tolist() == [0, 1, 5, 6] and r1.tolist() == [2, 3, 4]  # chunks (0,2),(5,2) | (2,2),(4,1)


def test_pointwise_keeps_the_zigzag_and_equals_one_device():
    """Operands broadcast, split on another dim, contiguously split on the zigzag dim or zigzag: the
    result stays zigzag and equals one device, with no bytes for a Broadcast operand."""
    torch.manual_seed(0)
    a, b, row, col = torch.randn(2, 9, 3, dtype=D), torch.randn(2, 9, 3, dtype=D), torch.randn(3, dtype=D), \
        torch.randn(9, 1, dtype=D)

    def body():
        p = gt.placement("cpu", [0, 1, 2])
        x = gt.to_global(a, p, gt.zigzag(1)).requires_grad_()
        with gt.comm_log() as log:
            y = x * gt.to_global(b, p, gt.broadcast) + gt.to_global(row, p, gt.broadcast)
            y = torch.where(gt.to_global(col, p, gt.broadcast) > 0, y, y.exp())
        assert log.recv_bytes == 0 and y.sbp == (gt.zigzag(1),)
        z = y + gt.to_global(b, p, gt.split(1))  # the contiguous operand is boxed to the zigzag
        z.add_(1.0)
        assert isinstance(z, gt.ZigzagTensor) and z.sbp == (gt.zigzag(1),)
        z.sum().backward()
        return z.full_tensor(), x.grad.full_tensor(), x.grad.sbp

    xa = a.clone().requires_grad_()
    y = xa * b + row
    y = torch.where(col > 0, y, y.exp())
    want = y + b + 1.0
    want.sum().backward()
    for out, grad, sbp in gt.launch(body, 3):
        torch.testing.assert_close(out, want.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(grad, xa.grad, atol=1e-12, rtol=1e-12)
        assert sbp == (gt.zigzag(1),)


def test_ops_along_the_dim_get_a_contiguous_split_and_in_place_ones_are_refused():
    full = torch.arange(10.0, dtype=D).reshape(5, 2)

    def body():
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(full, p, gt.zigzag(0))
        cum = x.cumsum(0)  # depends on the row order: computed on the contiguous split
        v = x.view(10)     # merges the zigzag dim: likewise
        b = gt.to_global(torch.zeros(5, 2, dtype=D), p, gt.broadcast)
        b.add_(x)          # writes a Broadcast tensor: x is boxed, b keeps its layout
        try:
            x.cumsum_(0)
            refused = None
        except NotImplementedError as e:
            refused = str(e)
        return cum.full_tensor(), cum.sbp, v.full_tensor(), b.full_tensor(), b.sbp, refused
    for cum, contiguous, v, b, b_sbp, refused in gt.launch(body, 2):
        assert torch.equal(cum, full.cumsum(0)) and contiguous
        assert torch.equal(v, full.view(10)) and torch.equal(b, full) and b_sbp == (gt.broadcast,)
        assert refused is not None and "cumsum_" in refused and "zigzag" in refused and "S(0)" in refused


def test_bad_zigzag_layouts_name_the_sbp():
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="after its zigzag on mesh axis 0"):
        gt.Layout(p, (gt.zigzag(1), gt.split(1)))
    with pytest.raises(ValueError, match="2 zigzag axes"):
        gt.Layout(p, (gt.zigzag(0), gt.zigzag(1)))
    with pytest.raises(ValueError, match="zigzag\\(dim\\)"):
        gt.zigzag(-1)
    with pytest.raises(TypeError, match="Layout.ranges"):
        gt.Layout(p, (gt.zigzag(0), gt.broadcast)).shard((4, 4), 0)
    with pytest.raises(ValueError, match="splits dim 2"):
        gt.Layout(p, (gt.zigzag(2), gt.broadcast)).check_shape((4, 4))


@st.composite
def _zigzag_conversions(draw):
    """A mesh of one or two axes, a shape, and two layouts of it of which at least one is zigzag (on any
    axis, any dim; earlier axes may split that dim first, the others split other dims, broadcast or, in
    the source, are partial)."""
    mesh = draw(st.sampled_from([(2,), (3,), (4,), (2, 2), (1, 3), (3, 1)]))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))

    def layout(zigzag: bool, partial: bool) -> tuple:
        sbp = [draw(st.sampled_from([gt.broadcast] + [gt.split(d) for d in range(len(shape))]
                                    + ([gt.partial_sum] if partial else []))) for _ in mesh]
        if zigzag:
            axis, dim = draw(st.integers(0, len(mesh) - 1)), draw(st.integers(0, len(shape) - 1))
            sbp = [gt.broadcast if isinstance(s, gt.Split) and s.dim == dim and b > axis else s
                   for b, s in enumerate(sbp)]  # earlier axes may split the dim first
            sbp[axis] = gt.zigzag(dim)
        return tuple(sbp)
    first = draw(st.booleans())
    return mesh, shape, layout(first, True), layout(not first or draw(st.booleans()), False)


@settings(max_examples=12)
@given(_zigzag_conversions(), st.integers(0, 2 ** 16))
def test_any_zigzag_conversion_keeps_values_and_meets_the_bound(case, seed):
    """Random meshes, shapes and layouts: the value is kept, each rank receives the route's bytes, and
    for a Partial-free source that is the lower bound."""
    mesh, shape, src, dst = case
    torch.manual_seed(seed)
    full = torch.randn(shape, dtype=D)

    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(full, p, src)
        route = gt.boxing.route(x.global_layout, gt.Layout(p, dst), shape, D)
        with gt.comm_log() as log:
            y = x.to_global(p, dst)
        return torch.equal(y.full_tensor(), full), log.recv_bytes == route.recv_bytes_of(gt.rank()), \
            route.lower_bound is None or route.recv_bytes == list(route.lower_bound)
    for ok in gt.launch(body, math.prod(mesh)):
        assert ok == (True, True, True), (src, dst, shape)


def _gpt_steps(batch_sbp, steps: int, mesh: tuple = (2,)):
    """A 2-layer GPT (a sequence of 16 tokens per rank of mesh axis 0 on a 2-D mesh, fp64), weights
    Broadcast, the batch laid out as `batch_sbp`, ring attention: AdamW steps; per rank the losses, the
    parameters and what each step received (kinds and bytes)."""
    from collections import Counter

    from globaltensor.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8)
    torch.manual_seed(0)
    batch = mesh[0] if len(mesh) == 2 else 1
    idx, tgt = torch.randint(0, 32, (batch, 16)), torch.randint(0, 32, (batch, 16))

    def run(p):
        torch.manual_seed(1)
        model = GPT(cfg).double()
        if p is not None:
            model = gt.to_global(model, p, {})
        x, y = (idx, tgt) if p is None else (gt.to_global(t, p, batch_sbp) for t in (idx, tgt))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, moved = [], []
        for _ in range(steps):
            with gt.attention_method("ring"), gt.comm_log() as log:
                loss = model(x, y)[1]
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
            moved.append((Counter(e.kind for e in log.events), log.recv_bytes))
        return losses, {n: q.detach() if p is None else q.full_tensor() for n, q in model.named_parameters()}, moved
    ranks = torch.arange(math.prod(mesh)).reshape(mesh).tolist()
    return run(None), gt.launch(lambda: run(gt.placement("cpu", ranks)), math.prod(mesh))


@pytest.mark.parametrize("mesh, zigzag, contiguous", [
    ((2,), (gt.zigzag(1),), (gt.split(1),)),
    ((2, 2), (gt.split(0), gt.zigzag(1)), (gt.split(0), gt.split(1))),   # data x sequence, a sequence per row
])
def test_gpt_steps_on_zigzag_equal_one_device_and_move_what_the_contiguous_ring_moves(mesh, zigzag, contiguous):
    """The tokens zigzag, every activation stays zigzag (embeddings, linears and their flattening of
    [batch, seq], layer norms, the loss run on the zigzag reading; attention is the ring): AdamW steps
    equal one device, and each step receives exactly the contiguous ring's messages and bytes
    (no recut anywhere)."""
    steps = 2 if len(mesh) == 1 else 1  # the 2-D run's decisions cost most (4 ranks, three programs)
    (want_losses, want, _), zig = _gpt_steps(zigzag, steps, mesh)
    _, contiguous = _gpt_steps(contiguous, steps, mesh)
    for (losses, params, moved), (_, _, moved_contiguous) in zip(zig, contiguous):
        torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-10)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=0, atol=1e-10, msg=name)
        assert moved == moved_contiguous and "send_recv" in moved[0][0]


def test_factories_make_zigzag_tensors_with_one_devices_values():
    torch.manual_seed(3)
    want = torch.randn(5, 2)

    def body():
        p = gt.placement("cpu", [0, 1])
        torch.manual_seed(3)
        r = gt.randn(5, 2, placement=p, sbp=gt.zigzag(0))
        z = gt.ones(5, 2, placement=p, sbp=gt.zigzag(0))
        return r.full_tensor(), r.sbp, z.full_tensor(), z.to_local().shape
    for r, sbp, z, local in gt.launch(body, 2):
        assert torch.equal(r, want) and sbp == (gt.zigzag(0),) and torch.equal(z, torch.ones(5, 2))
        assert local[0] in (2, 3)


def test_operands_zigzag_on_other_dims_or_axes_are_read_alike():
    """x zigzag on dim 0 of axis 0, y on dim 1 of axis 1 (a split of dim 0 on the other axis): sums,
    transposes and products of them equal one device."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 7, dtype=D), torch.randn(5, 7, dtype=D)

    def body():
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        x = gt.to_global(a, p, (gt.zigzag(0), gt.broadcast))
        y = gt.to_global(b, p, (gt.split(0), gt.zigzag(1)))
        return (x + y).full_tensor(), ((x * 2).t() * y.t()).full_tensor(), (x @ y.t()).full_tensor()
    for s, t, m in gt.launch(body, 4):
        torch.testing.assert_close(s, a + b, rtol=0, atol=1e-12)
        torch.testing.assert_close(t, (a * 2).t() * b.t(), rtol=0, atol=1e-12)
        torch.testing.assert_close(m, a @ b.t(), rtol=1e-12, atol=1e-12)
