"""View ops: splits travel through dim maps (reshape groups included); what cannot travel is boxed and counted."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

import globaltensor as gt
from globaltensor.ops import decide
from ops_support import Mesh, check, meshes, mesh_placement, sbps_for, world_of

D = torch.float64
VIEWS = {
    "heads": lambda x: x.view(x.shape[0], x.shape[1], 2, x.shape[2] // 2).transpose(1, 2).reshape(x.shape[0], 2, -1),
    "flatten": lambda x: x.flatten(0, 1) * 2,
    "permute": lambda x: x.permute(2, 0, 1).contiguous(),
    "unsqueeze_expand": lambda x: x.unsqueeze(1).expand(-1, 3, -1, -1) + 0,
    "squeeze": lambda x: x[:, :1].squeeze(1),
    "split_cat": lambda x: torch.cat(list(reversed(x.split(1, dim=1))), dim=1),
    "chunk_stack": lambda x: torch.stack(x.chunk(2, dim=2), dim=0),
    "slice_select": lambda x: x[:, 1:, :].select(0, 0) + x[-1, 1:],
    "t": lambda x: x[0].t() @ x[0],
    "pad_zero": lambda x: F.pad(x, (1, 2)),
    "pad_value": lambda x: F.pad(x, (0, 0, 2, 1), value=0.5),
    "pad_crop": lambda x: F.pad(x, (-1, 1, 0, 0, 1, 0)),
}


@given(meshes(), st.integers(1, 4), st.integers(2, 5), st.sampled_from([2, 4, 6]),
       st.sampled_from(sorted(VIEWS)), st.data())
def test_views_match_one_device(mesh, b, s, h, name, data):
    shape = (b, s, h)
    sbp = data.draw(sbps_for(mesh, shape, partial=True))
    torch.manual_seed(3)
    check(VIEWS[name], [torch.randn(shape, dtype=D)], mesh, [sbp])


def test_head_split_travels_through_reshape_for_free():
    def body():
        p = mesh_placement((2,))
        x = gt.to_global(torch.randn(2, 3, 8), p, gt.split(2))
        with gt.comm_log() as log:
            y = x.view(2, 3, 4, 2).transpose(1, 2)
        return y.sbp, log.recv_bytes
    assert gt.launch(body, 2)[0] == ((gt.split(1),), 0)


def test_split_a_view_cannot_carry_is_boxed_and_counted():
    gt.reset_stats()

    def body():
        p = mesh_placement((2,))
        x = gt.to_global(torch.arange(15.0).reshape(5, 3), p, gt.split(1))  # 3 cols over 2 ranks: 2 + 1
        return x.reshape(15).full_tensor()
    for r in gt.launch(body, 2):
        assert torch.equal(r, torch.arange(15.0))
    assert gt.stats()["boxed"].get("aten.view.default", 0) >= 2


def test_pad_keeps_the_splits_of_dims_it_does_not_pad():
    def body():
        p = mesh_placement((2, 2))
        x = gt.to_global(torch.randn(4, 5, 6), p, (gt.split(0), gt.split(1)))
        with gt.comm_log() as log:
            y = F.pad(x, (1, 2))                   # zeros
            z = F.pad(x, (0, 1), value=1.0)        # a constant
            w = F.pad(x, (-1, -2))                 # a crop
        return [t.sbp for t in (y, z, w)], log.recv_bytes, y.full_tensor().shape
    sbps, received, shape = gt.launch(body, 4)[0]
    assert sbps == [(gt.split(0), gt.split(1))] * 3 and received == 0 and shape == (4, 5, 9)


def _size_one_split(mesh: list, sbp: tuple, out_shape: tuple):
    x = torch.arange(128.0).reshape(1, 8, 16)
    p = gt.placement("cpu", mesh)
    g = gt.to_global(x, p, sbp).requires_grad_()
    with gt.comm_log() as log:
        y = g.reshape(out_shape)
        y.backward(gt.to_global(torch.ones(out_shape), p, y.sbp))
    return y.sbp, log.recv_bytes, y.full_tensor(), g.grad.full_tensor()


def test_a_split_size_one_dim_carries_to_a_size_one_dim_of_the_reshape():
    """A split of a size-1 dim (a single routing group on an expert axis: the first rank holds all, the
    others nothing) is the same placement on any size-1 dim: a reshape carries it there, moving nothing,
    forward and backward (it was re-cut over a dim of real size, an all-to-all each way)."""
    x = torch.arange(128.0).reshape(1, 8, 16)
    for mesh, sbp, want in (([0, 1], (gt.split(0),), (gt.split(1),)),
                            ([[0, 1], [2, 3]], (gt.split(0), gt.broadcast), (gt.split(1), gt.broadcast)),
                            ([[0, 1], [2, 3]], (gt.split(0), gt.split(2)), (gt.split(1), gt.split(3)))):
        n = len(sum(mesh, [])) if isinstance(mesh[0], list) else len(mesh)
        for got, received, y, grad in gt.launch(_size_one_split, n, args=(mesh, sbp, (8, 1, 1, 16))):
            assert got == want and received == 0
            assert torch.equal(y, x.reshape(8, 1, 1, 16)) and torch.equal(grad, torch.ones(1, 8, 16))


def _mirror_lacks(layout: gt.Layout, shape: tuple, dims: set, rank: int) -> int:
    """Elements of its shard a rank lacks after flipping it: those of its place's mirror image it does not hold."""
    box = layout.shard(shape, rank)
    if box is None:
        return 0
    mirror = [(n - s - k, k) if d in dims else (s, k) for d, ((s, k), n) in enumerate(zip(box, shape))]
    held = math.prod(max(min(s + k, m + j) - max(s, m), 0) for (s, k), (m, j) in zip(box, mirror))
    return math.prod(k for _, k in box) - held


def _flip_on(mesh, shape, sbp, dims):
    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(torch.arange(float(math.prod(shape)), dtype=D).reshape(shape), p, sbp).requires_grad_()
        with gt.comm_log() as log:
            y = x.flip(dims)
        y.backward(gt.to_global(torch.arange(float(math.prod(shape)), dtype=D).reshape(shape) ** 2, p, y.sbp))
        return y.full_tensor(), x.grad.full_tensor(), log.recv_bytes, y.sbp, gt.rank() in p.flat_ranks
    return gt.launch(body, world_of(mesh))


@st.composite
def flips(draw):
    """(mesh, shape, nd-SBP, dims to flip): uneven and empty dims, Partial, worlds larger than the mesh."""
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    dims = draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1, max_size=len(shape),
                         unique_by=lambda d: d % len(shape)))
    return mesh, shape, draw(sbps_for(mesh, shape, partial=True)), dims


@given(flips())
@example((Mesh((4,)), (7,), (gt.split(0),), [0]))
@example((Mesh((2, 2)), (5, 3), (gt.split(0), gt.split(0)), [-2]))
def test_flip_matches_one_device_and_moves_at_most_the_mirror_rows(case):
    """Values and gradients equal one device's for any layout. Flipping dims no mesh axis splits moves
    nothing and keeps the layout; flipping a split dim moves at most what the busiest rank lacks of
    its shard after flipping it (the mirror exchange; the dispatcher may find a cheaper conversion,
    an all-to-all to another dim's split). A Partial input may be reduced on the way, when that is no
    dearer than what it owes (its cheapest reduction)."""
    mesh, shape, sbp, dims = case
    flipped = {d % len(shape) for d in dims}
    t = torch.arange(float(math.prod(shape)), dtype=D).reshape(shape)
    results = _flip_on(mesh, shape, sbp, dims)
    for y, grad, _, _, inside in results:
        if inside:
            assert torch.equal(y, t.flip(dims)) and torch.equal(grad, (t ** 2).flip(dims))
    received = [r for _, _, r, _, _ in results]
    layout = gt.Layout(mesh_placement(mesh), sbp)
    owed = max(decide.owed_by(layout, shape, D)[0], default=0)
    lacks = max(_mirror_lacks(layout, shape, flipped, r) for r in range(len(results)))
    assert max(received) <= 8 * lacks + owed
    if lacks == owed == 0:
        assert received == [0] * len(results) and results[0][3] == sbp


def test_flip_of_a_split_dim_swaps_mirror_rows_and_keeps_the_split():
    """1-D, 8 rows over 4 ranks, S(0): rank i takes rank 3-i's two rows (point to point, 16 B), where
    converting (a gather, or Partial and its reduction) would move 48 B to each rank."""
    for y, grad, received, sbp, _ in _flip_on(Mesh((4,)), (8,), (gt.split(0),), [0]):
        assert torch.equal(y, torch.arange(8.0, dtype=D).flip(0)) and sbp == (gt.split(0),) and received == 16


CUT_WRITES = {  # name -> (write, whether the view crosses the split of x, S(0) over 2 ranks)
    "slice": (lambda x: x[2:5].fill_(1), True),
    "select": (lambda x: x[3].fill_(1), True),
    "setitem": (lambda x: x.__setitem__(slice(2, 5), 1.0), True),
    "narrow": (lambda x: x.narrow(0, 2, 3).fill_(1), True),
    "chunk": (lambda x: x.chunk(2)[1].mul_(3), True),
    "reshape-select": (lambda x: x.view(4, 8)[1].fill_(1), True),
    "view-of-a-cut": (lambda x: x[2:6][1:2].add_(1), True),
    "columns": (lambda x: x.__setitem__((slice(None), slice(1, 3)), 2.0), False),
    "transposed-row": (lambda x: x.t()[0].fill_(1), False),
    "clone-of-a-cut": (lambda x: x[2:5].clone().fill_(1), False),
}


@pytest.mark.parametrize("name", sorted(CUT_WRITES))
def test_a_write_through_a_view_reaches_the_tensor_or_is_refused(name):
    """One device writes through a view into its base. A view whose input had to be gathered for it (a slice
    or select of the split dim) is a copy: a write into it would be lost, silently (it was: issue 34), so it
    raises, naming the view; a view that keeps a split writes through, as on one device."""
    write, crosses = CUT_WRITES[name]
    base = torch.arange(32.).reshape(8, 4)
    want = base.clone()
    write(want)

    def body():
        x = gt.to_global(base.clone(), gt.placement("cpu", [0, 1]), gt.split(0))
        try:
            write(x)
        except RuntimeError as e:
            return str(e)
        return x.full_tensor()
    got = gt.launch(body, 2)
    for g in got:
        if crosses:
            assert isinstance(g, str) and "writes into a view" in g and "gathered copy" in g, g
        else:
            torch.testing.assert_close(g, want)


def _slice_lacks(shape: tuple, layout: gt.Layout, out_layout: gt.Layout, out_shape: tuple, dim: int, shift: int,
                 rank: int) -> int:
    """Elements of its block of the result a rank does not hold: rows of the result whose source row
    (result row - shift, inside the input) another rank holds, on the rows it holds of the other dims."""
    box, out = layout.shard(shape, rank), out_layout.shard(out_shape, rank)
    if box is None:
        return 0
    (s, k), (o, m) = box[dim], out[dim]
    rows = len({t - shift for t in range(o, o + m)} & set(range(shape[dim])) - set(range(s, s + k)))
    return rows * math.prod(n for d, (_, n) in enumerate(out) if d != dim)
CUTS = {  # name -> (cut of x along dim d: its results, a list), as a user writes them
    "narrow": lambda x, d: [x.narrow(d, 1, x.shape[d] - 2)],
    "slice": lambda x, d: [x[(slice(None),) * d + (slice(x.shape[d] // 2, None),)]],
    "chunk": lambda x, d: list(x.chunk(2, d)),
    "split_sizes": lambda x, d: list(x.split([1, x.shape[d] - 3, 2], d)),
    "cat": lambda x, d: [torch.cat([x.narrow(d, 1, x.shape[d] - 1), x * 2, x.narrow(d, 0, 2)], d)],
}


def _recut_lacks(layout: gt.Layout, shape: tuple, d: int, pieces: list, rank: int) -> int:
    """Elements of its results' shards (each result laid out as the input) a rank does not hold of the input:
    `pieces` gives each result's rows as (input row, count) runs along d, in result order."""
    box = layout.shard(shape, rank)
    if box is None:
        return 0
    lacks = 0
    for runs in pieces:
        n = sum(k for _, k in runs)
        out_shape = shape[:d] + (n,) + shape[d + 1:]
        mine = layout.shard(out_shape, rank)
        (s, k), other = mine[d], math.prod(k for i, (_, k) in enumerate(mine) if i != d)
        rows, at = [], 0
        for start, count in runs:  # the input rows of result rows [s, s + k)
            lo, hi = max(s, at), min(s + k, at + count)
            rows += range(start + lo - at, start + hi - at) if hi > lo else []
            at += count
        held = range(box[d][0], box[d][0] + box[d][1])
        lacks += sum(1 for r in rows if r not in held) * other
    return lacks


@st.composite
def slices_and_pads(draw):
    """(mesh, shape, SBP splitting `dim` on axis 0, dim, op name, a, b): slices (step 1 or 2), narrow and pads
    (negative pads crop) of a split dim, uneven and empty blocks."""
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    sbp = (gt.split(dim),) + draw(sbps_for(Mesh(mesh[1:]), shape))[:len(mesh) - 1] if len(mesh) > 1 else (gt.split(dim),)
    op = draw(st.sampled_from(["slice", "slice2", "narrow", "pad"]))
    n = shape[dim]
    if op == "pad":
        a, b = draw(st.integers(-n + 1, 4)), draw(st.integers(-n + 1, 4))
        if a + b <= -n:
            b = 0
    else:
        a = draw(st.integers(-n, n - 1))
        b = draw(st.integers(a % n + 1, n)) - a % n
    return mesh, shape, sbp, dim, op, a, b


def _cut(x, dim: int, op: str, a: int, b: int):
    n = x.shape[dim]
    if op == "slice":
        return x[(slice(None),) * dim + (slice(a, a + b if a >= 0 else (a + b) or None),)]
    if op == "slice2":
        return x[(slice(None),) * dim + (slice(a % n, None, 2),)]
    if op == "narrow":
        return x.narrow(dim, a, b)
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [a, b], value=0.5)


@given(slices_and_pads())
@example((Mesh((4,)), (9, 2), (gt.split(0),), 0, "slice", 1, 7))
@example((Mesh((2, 2)), (7, 4), (gt.split(0), gt.split(0)), 0, "pad", 3, -2))
def test_slices_and_pads_of_a_split_dim_keep_it_and_move_only_the_rows_a_rank_lacks(case):
    """A contiguous slice (step 1), a narrow or a pad of a split dim: the result keeps that split, values and
    gradients as on one device, each rank receiving at most the rows of its block of the result that
    another rank holds (a shift, point to point), where converting to another dim's split would move the
    whole tensor. A strided slice may convert: only its values are checked."""
    mesh, shape, sbp, dim, op, a, b = case
    t = torch.arange(float(math.prod(shape)), dtype=D).reshape(shape)
    want = _cut(t, dim, op, a, b)
    tr = t.clone().requires_grad_()
    (_cut(tr, dim, op, a, b) ** 2).sum().backward()

    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(t, p, sbp).requires_grad_()
        with gt.comm_log() as log:
            y = _cut(x, dim, op, a, b)
        (y ** 2).sum().backward()
        return y.full_tensor(), x.grad.full_tensor(), log.recv_bytes, y.sbp, gt.rank() in p.flat_ranks
    results = gt.launch(body, world_of(mesh))
    for y, grad, _, _, inside in results:
        if inside:
            torch.testing.assert_close(y, want, rtol=0, atol=0)
            torch.testing.assert_close(grad, tr.grad, rtol=0, atol=0)
    if op == "slice2":
        return
    start = 0 if op == "pad" else (a % shape[dim] if op != "slice" or a >= -shape[dim] else 0)
    shift = a if op == "pad" else -start
    layout = gt.Layout(mesh_placement(mesh), sbp)
    out_layout = gt.Layout(mesh_placement(mesh), results[0][3])
    if results[0][3] == sbp:
        for r, (_, _, received, _, _) in enumerate(results):
            assert received == 8 * _slice_lacks(shape, layout, out_layout, tuple(want.shape), dim, shift, r)
    else:  # another layout only where it moved less than the shift
        shifts = max(8 * _slice_lacks(shape, layout, gt.Layout(layout.placement, sbp), tuple(want.shape), dim,
                                      shift, r) for r in range(len(results)))
        assert max(r for _, _, r, _, _ in results) <= shifts


@st.composite
def cuts(draw):
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(st.integers(3, 7), min_size=1, max_size=3)))
    d = draw(st.integers(0, len(shape) - 1))
    return mesh, shape, draw(sbps_for(mesh, shape, partial=True)), d, draw(st.sampled_from(sorted(CUTS)))


def _runs(name: str, n: int) -> list:
    """Each result's input rows as (start, count) runs (the cat's middle piece is x * 2: all of x's rows)."""
    return {"narrow": [[(1, n - 2)]], "slice": [[(n // 2, n - n // 2)]],
            "chunk": [[(i, min(-(-n // 2), n - i))] for i in range(0, n, -(-n // 2))],
            "split_sizes": [[(0, 1)], [(1, n - 3)], [(n - 2, 2)]],
            "cat": [[(1, n - 1), (0, n), (0, 2)]]}[name]


@given(cuts())
@example((Mesh((2,)), (4, 6), (gt.split(1),), 1, "chunk"))
@example((Mesh((2, 2)), (7, 3), (gt.split(0), gt.split(0)), 0, "split_sizes"))
@example((Mesh((3,)), (5,), (gt.split(0),), 0, "cat"))
def test_a_cut_along_a_split_dim_matches_one_device_and_moves_at_most_the_rows_a_rank_lacks(case):
    """slice, narrow, chunk, split and cat of a dim a mesh axis splits: values and gradients (the backward is
    slice_backward or cat) equal one device's, and no rank receives more in the forward than the busiest rank
    lacks of its results' rows (each laid out by the input's split: the recut, `ops/view.py`), plus what a
    Partial input owes (reduced whole, or each result); a cheaper conversion the dispatcher finds is within that."""
    mesh, shape, sbp, d, name = case
    t = torch.arange(float(math.prod(shape)), dtype=D).reshape(shape)

    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(t.clone(), p, sbp).requires_grad_()
        with gt.comm_log() as log:
            ys = CUTS[name](x, d)
        loss = sum((y * (k + 1) * y).sum() for k, y in enumerate(ys))
        loss.backward()
        return [y.full_tensor() for y in ys], x.grad.full_tensor(), log.recv_bytes, gt.rank() in p.flat_ranks
    x0 = t.clone().requires_grad_()
    want = CUTS[name](x0, d)
    sum((y * (k + 1) * y).sum() for k, y in enumerate(want)).backward()
    results = gt.launch(body, world_of(mesh))
    for ys, grad, _, inside in results:
        if inside:
            assert len(ys) == len(want) and all(torch.equal(a, b) for a, b in zip(ys, want))
            torch.testing.assert_close(grad, x0.grad)
    layout = gt.Layout(mesh_placement(mesh), sbp)
    runs = _runs(name, shape[d])
    # a Partial input is owed its reduction: before the cut, or of each result after it (passed Partial)
    results_owe = decide.summed([decide.owed_by(layout, shape[:d] + (sum(k for _, k in r),) + shape[d + 1:], D)
                                 for r in runs])[0]
    owed = max(max(decide.owed_by(layout, shape, D)[0], default=0), max(results_owe, default=0))
    lacks = max(_recut_lacks(layout, shape, d, runs, r) for r in range(len(results)))
    assert max(r for _, _, r, _ in results) <= 8 * lacks + owed


def test_packed_gate_and_up_split_on_their_packed_dim_move_half_a_shard():
    """transformers' gated MLP: `gate, up = (x @ w_gate_up.T).chunk(2, -1)` with the packed [2I] dim split over 2
    ranks (rank 0 holds all of gate, rank 1 all of up). Each half is recut to a split of its own I (rank 0 takes
    up's first half from rank 1, rank 1 gate's second half from rank 0): T*I/2 elements per rank, in the forward
    and again in the backward's cat; taking the halves Partial and reducing them would move twice that, and the
    product then computes with no further communication."""
    T, I = 16, 6

    def body():
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.arange(T * 2 * I, dtype=D).reshape(T, 2 * I) / 50, p, gt.split(1)).requires_grad_()
        with gt.comm_log() as fwd:
            gate, up = x.chunk(2, -1)
            h = F.silu(gate) * up
        with gt.comm_log() as bwd:
            h.backward(gt.to_global(torch.ones(T, I, dtype=D), p, h.sbp))
        return h.sbp, fwd.recv_bytes, bwd.recv_bytes, len(fwd.events), x.grad.full_tensor(), h.full_tensor()
    x0 = (torch.arange(T * 2 * I, dtype=D).reshape(T, 2 * I) / 50).requires_grad_()
    g0, u0 = x0.chunk(2, -1)
    h0 = F.silu(g0) * u0
    h0.sum().backward()
    for sbp, fwd, bwd, events, grad, h in gt.launch(body, 2):
        assert sbp == (gt.split(1),) and fwd == bwd == T * I // 2 * 8 and events == 1
        torch.testing.assert_close(h, h0)
        torch.testing.assert_close(grad, x0.grad)
