"""Structural ops (ops/structural.py) against one device: triangles and diagonals with split matrix dims
(the kernels that offset the diagonal by where a block sits), roll/rot90/repeat/unfold over the dims they
leave alone, select/slice/diagonal/masked scatters, take/put, index_fill/copy/reduce and scatter_reduce
split along the written dim, searches, count_nonzero, allclose, histograms, block_diag, _chunk_cat,
hash_tensor, _unsafe_masked_index. Values and gradients over any input nd-SBPs (Partial where the op is
linear), uneven shapes, worlds larger than the mesh; bytes where a rule communicates: a Partial diagonal
reduced, the rows roll and repeat exchange between ranks."""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor.runtime.comm import all_reduce_recv_bytes
from ops_support import check, mesh_placement, meshes, sbps_for

D = torch.float64
sizes = st.integers(1, 5)


@st.composite
def tensor_case(draw, min_dims: int = 1, max_dims: int = 3, partial: bool = True):
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(sizes, min_size=min_dims, max_size=max_dims)))
    return mesh, shape, draw(sbps_for(mesh, shape, partial=partial)), draw(st.integers(0, 9))


# -- triangles and diagonals ------------------------------------------------------------------------
TRI = {
    "tril": lambda x, k: torch.tril(x, k),
    "triu": lambda x, k: torch.triu(x, k),
    "tril_": lambda x, k: (x * 1).tril_(k),
    "triu_": lambda x, k: (x * 1).triu_(k),
}


@given(tensor_case(min_dims=2), st.integers(-4, 4), st.sampled_from(sorted(TRI)))
def test_triangles_match_one_device(case, k, name):
    mesh, shape, sbp, seed = case
    torch.manual_seed(seed)
    check(lambda x: TRI[name](x, k), [torch.randn(shape, dtype=D)], mesh, [sbp])


@st.composite
def diag_case(draw):
    mesh, shape, sbp, seed = draw(tensor_case(min_dims=2))
    n = len(shape)
    d1, d2 = draw(st.permutations(range(n)))[:2]
    return mesh, shape, sbp, seed, draw(st.integers(-3, 3)), d1, d2


@given(diag_case(), st.sampled_from(["diagonal", "diagonal_copy", "diagonal_twice"]))
def test_diagonal_matches_one_device(case, name):
    """A split matrix dim gives a Partial diagonal; its gradient (diagonal_backward) lands in the blocks."""
    mesh, shape, sbp, seed, offset, d1, d2 = case
    torch.manual_seed(seed)
    fns = {"diagonal": lambda x: torch.diagonal(x, offset, d1, d2) * 2,
           "diagonal_copy": lambda x: torch.diagonal_copy(x, offset, d1, d2),
           "diagonal_twice": lambda x: torch.diagonal(x, offset, d1, d2).sum(-1)}
    check(fns[name], [torch.randn(shape, dtype=D)], mesh, [sbp])


@st.composite
def embed_case(draw):
    mesh, shape, sbp, seed = draw(tensor_case(min_dims=1, max_dims=3))
    n = len(shape) + 1
    d1, d2 = draw(st.permutations(range(n)))[:2]
    return mesh, shape, sbp, seed, draw(st.integers(-3, 3)), d1, d2


@given(embed_case())
def test_diag_embed_matches_one_device(case):
    mesh, shape, sbp, seed, offset, d1, d2 = case
    torch.manual_seed(seed)
    check(lambda x: torch.diag_embed(x, offset, d1, d2), [torch.randn(shape, dtype=D)], mesh, [sbp])


@given(diag_case(), st.data())
def test_diagonal_scatter_matches_one_device(case, data):
    mesh, shape, sbp, seed, offset, d1, d2 = case
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=D)
    src = torch.randn(torch.diagonal(x, offset, d1, d2).shape, dtype=D)
    ssbp = data.draw(sbps_for(mesh, tuple(src.shape), partial=True))
    check(lambda x, s: torch.diagonal_scatter(x, s, offset, d1, d2), [x, src], mesh, [sbp, ssbp])


# -- ops that leave some dims alone -----------------------------------------------------------------
@given(tensor_case(), st.data())
def test_roll_rot90_repeat_unfold_match_one_device(case, data):
    mesh, shape, sbp, seed = case
    n = len(shape)
    torch.manual_seed(seed)
    name = data.draw(st.sampled_from(["roll", "roll_flat", "repeat", "unfold"] + (["rot90"] if n >= 2 else [])))
    if name == "roll":
        dims = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2, unique=True))
        shifts = [data.draw(st.integers(-6, 6)) for _ in dims]
        fn = lambda x: torch.roll(x, shifts, dims)  # noqa: E731
    elif name == "roll_flat":
        fn = lambda x: torch.roll(x, 3)  # noqa: E731
    elif name == "rot90":
        k = data.draw(st.integers(-4, 4))
        dims = data.draw(st.permutations(range(n)))[:2]
        fn = lambda x: torch.rot90(x, k, dims)  # noqa: E731
    elif name == "repeat":
        reps = [data.draw(st.sampled_from([1, 1, 2, 3])) for _ in range(n + data.draw(st.integers(0, 1)))]
        fn = lambda x: x.repeat(*reps)  # noqa: E731
    else:
        dim = data.draw(st.integers(0, n - 1))
        size = data.draw(st.integers(1, shape[dim]))
        step = data.draw(st.integers(1, 3))
        fn = lambda x: x.unfold(dim, size, step) * 1  # noqa: E731
    check(fn, [torch.randn(shape, dtype=D)], mesh, [sbp])


# -- select / slice scatters ------------------------------------------------------------------------
@given(tensor_case(), st.data())
def test_select_and_slice_scatter_match_one_device(case, data):
    mesh, shape, sbp, seed = case
    torch.manual_seed(seed)
    n = len(shape)
    dim = data.draw(st.integers(0, n - 1))
    x = torch.randn(shape, dtype=D)
    if data.draw(st.booleans()):
        index = data.draw(st.integers(-shape[dim], shape[dim] - 1))
        src = torch.randn(x.select(dim, index).shape, dtype=D)
        fn = lambda x, s: torch.select_scatter(x, s, dim, index)  # noqa: E731
    else:
        start = data.draw(st.one_of(st.none(), st.integers(-shape[dim], shape[dim])))
        end = data.draw(st.one_of(st.none(), st.integers(-shape[dim], shape[dim])))
        step = data.draw(st.integers(1, 3))
        src = torch.randn(x[(slice(None),) * dim + (slice(start, end, step),)].shape, dtype=D)
        fn = lambda x, s: torch.slice_scatter(x, s, dim, start, end, step)  # noqa: E731
    ssbp = data.draw(sbps_for(mesh, tuple(src.shape), partial=True))
    check(fn, [x, src], mesh, [sbp, ssbp])


# -- writes along a dim -----------------------------------------------------------------------------
WRITES = {
    "index_fill": lambda x, dim, i, s: x.index_fill(dim, i, -2.5) + s.sum(),
    "index_fill_tensor": lambda x, dim, i, s: x.index_fill(dim, i, s.sum()),
    "index_fill_": lambda x, dim, i, s: (x * 1).index_fill_(dim, i, 1.5) * s.sum(),
    "index_copy": lambda x, dim, i, s: x.index_copy(dim, i, s),
    "index_copy_": lambda x, dim, i, s: (x * 1).index_copy_(dim, i, s),
    "index_reduce_prod": lambda x, dim, i, s: x.index_reduce(dim, i, s, "prod"),
    "index_reduce_mean": lambda x, dim, i, s: x.index_reduce(dim, i, s, "mean", include_self=False),
    "index_reduce_amax_": lambda x, dim, i, s: (x * 1).index_reduce_(dim, i, s, "amax"),
}


@given(tensor_case(), st.sampled_from(sorted(WRITES)), st.data())
def test_index_writes_match_one_device(case, name, data):
    mesh, shape, sbp, seed = case
    dim = data.draw(st.integers(0, len(shape) - 1))
    k = data.draw(st.integers(1, shape[dim]))
    g = torch.Generator().manual_seed(seed)
    index = torch.randperm(shape[dim], generator=g)[:k]  # distinct: copies do not depend on write order
    x = torch.randn(shape, generator=g, dtype=D)
    src = torch.randn(shape[:dim] + (k,) + shape[dim + 1:], generator=g, dtype=D)
    isbp = data.draw(sbps_for(mesh, (k,)))
    ssbp = data.draw(sbps_for(mesh, tuple(src.shape), partial=True))
    check(lambda x, i, s: WRITES[name](x, dim, i, s), [x, index, src], mesh, [sbp, isbp, ssbp])


@given(tensor_case(), st.sampled_from(["sum", "prod", "mean", "amax", "amin"]), st.booleans(), st.data())
def test_scatter_reduce_matches_one_device(case, reduce, include_self, data):
    mesh, shape, sbp, seed = case
    dim = data.draw(st.integers(0, len(shape) - 1))
    ishape = tuple(data.draw(st.integers(1, s)) if data.draw(st.booleans()) else s for s in shape)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=D)
    index = torch.randint(0, shape[dim], ishape, generator=g)
    src = torch.randn(ishape, generator=g, dtype=D)
    isbp, ssbp = data.draw(sbps_for(mesh, ishape)), data.draw(sbps_for(mesh, ishape))
    # the gradient of prod/amax/amin is torch's own (and its ties); the values are the claim here
    grad = reduce in ("sum", "mean")
    check(lambda x, i, s: x.scatter_reduce(dim, i, s, reduce, include_self=include_self), [x, index, src],
          mesh, [sbp, isbp, ssbp], grad=grad)
    check(lambda x, i, s: (x * 1).scatter_(dim, i, s, reduce="multiply" if reduce == "prod" else "add"),
          [x, index, src], mesh, [sbp, isbp, ssbp], grad=False)


# -- take / put, masked_scatter ---------------------------------------------------------------------
@given(tensor_case(min_dims=0), st.data())
def test_take_and_put_match_one_device(case, data):
    mesh, shape, sbp, seed = case
    numel = 1
    for s in shape:
        numel *= s
    g = torch.Generator().manual_seed(seed)
    k = data.draw(st.integers(1, numel))
    index = torch.randperm(numel, generator=g)[:k] - data.draw(st.sampled_from([0, numel]))  # negatives too
    x = torch.randn(shape, generator=g, dtype=D)
    src = torch.randn(k, generator=g, dtype=D)
    isbp = data.draw(sbps_for(mesh, (k,)))
    ssbp = data.draw(sbps_for(mesh, (k,), partial=True))
    acc = data.draw(st.booleans())
    check(lambda x, i, s: torch.take(x, i) * s, [x, index, src], mesh, [sbp, isbp, ssbp])
    check(lambda x, i, s: x.put(i, s, accumulate=acc), [x, index, src], mesh, [sbp, isbp, ssbp])
    check(lambda x, i, s: (x * 1).put_(i, s, accumulate=acc), [x, index, src], mesh, [sbp, isbp, ssbp])


@given(tensor_case(), st.data())
def test_masked_scatter_matches_one_device(case, data):
    """The source is read in the order of the whole mask's True entries: each rank counts those before its block."""
    mesh, shape, sbp, seed = case
    g = torch.Generator().manual_seed(seed)
    mshape = shape[data.draw(st.integers(0, len(shape) - 1)):]  # the mask may broadcast
    mask = torch.rand(mshape, generator=g) > 0.5
    x = torch.randn(shape, generator=g, dtype=D)
    src = torch.randn(x.numel() + 1, generator=g, dtype=D)
    msbp = data.draw(sbps_for(mesh, mshape))
    ssbp = data.draw(sbps_for(mesh, (x.numel() + 1,), partial=True))
    check(lambda x, m, s: x.masked_scatter(m, s), [x, mask, src], mesh, [sbp, msbp, ssbp])
    check(lambda x, m, s: (x * 1).masked_scatter_(m, s), [x, mask, src], mesh, [sbp, msbp, ssbp])


# -- lookups and counts -----------------------------------------------------------------------------
@given(tensor_case(partial=False), st.data())
def test_searches_and_counts_match_one_device(case, data):
    mesh, shape, sbp, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 8, shape, generator=g).to(D)
    seq1 = torch.sort(torch.randint(0, 8, (data.draw(sizes),), generator=g).to(D)).values
    seqn = torch.sort(torch.randint(0, 8, shape[:-1] + (data.draw(sizes),), generator=g).to(D), -1).values
    right = data.draw(st.booleans())
    s1 = data.draw(sbps_for(mesh, tuple(seq1.shape)))
    sn = data.draw(sbps_for(mesh, tuple(seqn.shape)))
    check(lambda x, t: torch.isin(x, t, invert=right), [x, seq1], mesh, [sbp, s1], grad=False)
    check(lambda x, b: torch.bucketize(x, b, right=right), [x, seq1], mesh, [sbp, s1], grad=False)
    check(lambda s, x: torch.searchsorted(s, x, right=right), [seq1, x], mesh, [s1, sbp], grad=False)
    check(lambda s, x: torch.searchsorted(s, x, side="right" if right else "left"), [seqn, x], mesh, [sn, sbp],
          grad=False)
    dims = data.draw(st.lists(st.integers(0, len(shape) - 1), max_size=2, unique=True))
    check(lambda x: torch.count_nonzero(x - 3, dims or None), [x], mesh, [sbp], grad=False)
    check(lambda x: torch.count_nonzero(x - 3, dims[0] if dims else None), [x], mesh, [sbp], grad=False)


@given(tensor_case(partial=False), st.data())
def test_allclose_and_spaces_match_one_device(case, data):
    mesh, shape, sbp, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=D)
    y = x + data.draw(st.sampled_from([0.0, 1e-9, 1e-3])) * torch.randn(shape, generator=g, dtype=D)
    if data.draw(st.booleans()):
        x.view(-1)[0] = y.view(-1)[0] = float("nan")
    ysbp = data.draw(sbps_for(mesh, shape))
    nan = data.draw(st.booleans())

    def close(x, y):
        return torch.tensor(float(torch.allclose(x, y, rtol=1e-6, atol=1e-7, equal_nan=nan)))
    want = close(x, y)

    def body():
        p = mesh_placement(mesh)
        return close(gt.to_global(x, p, sbp), gt.to_global(y, p, ysbp))
    assert all(torch.equal(got, want) for got in gt.launch(body, getattr(mesh, "world", 1)))
    steps = data.draw(st.integers(0, 7))
    check(lambda a, b: torch.linspace(a, b, steps) * 1, [torch.tensor(-1.5, dtype=D), torch.tensor(2.0, dtype=D)],
          mesh, [(gt.broadcast,) * len(mesh)] * 2, grad=False)
    check(lambda a: torch.logspace(a, 2.0, steps, base=2.0) * 1, [torch.tensor(-1.5, dtype=D)],
          mesh, [(gt.broadcast,) * len(mesh)], grad=False)


# -- what moves ---------------------------------------------------------------------------------------
def test_split_matrix_diagonal_and_triangle_move_nothing_but_the_diagonal():
    """tril_ of a row-split matrix stays split with nothing received; the main diagonal of a square one is a
    split view of the shards (a write through it lands); an off-diagonal copy is Partial, and reading it
    whole costs one all-reduce of the diagonal (n - 1 elements), not the matrix's gather."""
    n, ranks = 8, 4
    t = torch.arange(n * n, dtype=torch.float32).reshape(n, n)

    def body():
        p = mesh_placement((ranks,))
        x = gt.to_global(t, p, gt.split(0))
        with gt.comm_log() as log:
            low = (x * 1).tril_(1)
            main = low.diagonal()
            main.fill_(-1.0)
            off = torch.diagonal_copy(x, -1)
        moved = log.recv_bytes
        with gt.comm_log() as log:
            whole = off.full_tensor()
        return low.sbp, main.sbp, off.sbp, moved, log.recv_bytes, low.full_tensor(), whole
    want = torch.tril(t, 1)
    want.diagonal().fill_(-1.0)
    for rank, (lsbp, msbp, osbp, moved, reduced, low, whole) in enumerate(gt.launch(body, ranks)):
        assert lsbp == msbp == (gt.split(0),) and osbp == (gt.partial_sum,) and moved == 0
        assert reduced == all_reduce_recv_bytes(n - 1, 4, ranks, rank)
        assert torch.equal(low, want) and torch.equal(whole, torch.diagonal(t, -1))


# -- histograms, block_diag, _chunk_cat, hash_tensor, _unsafe_masked_index -----------------------------
@given(tensor_case(partial=False), st.data())
def test_histograms_match_one_device(case, data):
    """Counts over split points are Partial where the edges are fixed: a bins tensor or a range."""
    mesh, shape, sbp, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=D)
    w = torch.rand(shape, generator=g, dtype=D)
    wsbp = data.draw(sbps_for(mesh, shape))
    edges = torch.sort(torch.randn(data.draw(st.integers(2, 6)), generator=g, dtype=D)).values
    bins = data.draw(st.integers(1, 6))
    check(lambda x, w: tuple(torch.histogram(x, bins, range=(-1.0, 1.5), weight=w)), [x, w], mesh, [sbp, wsbp],
          grad=False)
    check(lambda x, e: tuple(torch.histogram(x, e)), [x, edges], mesh, [sbp, (gt.broadcast,) * len(mesh)],
          grad=False)
    check(lambda x: tuple(torch.histogram(x, bins)), [x], mesh, [sbp], grad=False)  # edges from min/max: whole
    points = x.reshape(-1, shape[-1])[:, :2]
    psbp = data.draw(sbps_for(mesh, tuple(points.shape)))
    dd = [2] * points.shape[1]
    ranges = [-1.0, 1.0] * points.shape[1]
    check(lambda p: (torch.histogramdd(p, dd, range=ranges).hist,), [points], mesh, [psbp], grad=False)
    check(lambda p: (torch.histogramdd(p, [edges] * points.shape[1]).hist,), [points], mesh, [psbp], grad=False)


@given(meshes(), st.lists(st.tuples(st.integers(0, 2), sizes, sizes), min_size=1, max_size=3), st.data())
def test_block_diag_matches_one_device(mesh, specs, data):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn((r, c)[:nd], generator=g, dtype=D) for nd, r, c in specs]
    sbps = [data.draw(sbps_for(mesh, tuple(x.shape), partial=True)) for x in xs]
    check(lambda *xs: torch.block_diag(*xs), xs, mesh, sbps)


@given(tensor_case(min_dims=2, partial=True), st.data())
def test_chunk_cat_and_hash_tensor_match_one_device(case, data):
    mesh, shape, sbp, seed = case
    g = torch.Generator().manual_seed(seed)
    dim = data.draw(st.integers(1, len(shape) - 1))
    x = torch.randn(shape, generator=g, dtype=D)
    y = torch.randn(shape[:dim] + (data.draw(sizes),) + shape[dim + 1:], generator=g, dtype=D)
    ysbp = data.draw(sbps_for(mesh, tuple(y.shape), partial=True))
    chunks = data.draw(st.integers(1, 4))
    check(lambda x, y: torch.ops.aten._chunk_cat([x, y], dim, chunks), [x, y], mesh, [sbp, ysbp], grad=False)
    if not any(s == gt.partial_sum for s in sbp):
        check(lambda x: torch.ops.aten.hash_tensor(x, [dim]), [x.float()], mesh, [sbp], grad=False)


@given(tensor_case(min_dims=2, max_dims=2, partial=True), st.data())
def test_unsafe_masked_index_matches_one_device(case, data):
    """The upsampling decomposition's read, and its backward (the accumulating put)."""
    mesh, shape, sbp, seed = case
    g = torch.Generator().manual_seed(seed)
    a, b = data.draw(sizes), data.draw(sizes)
    i0 = torch.randint(-1, shape[0] + 1, (a, 1), generator=g)
    i1 = torch.randint(-1, shape[1] + 1, (1, b), generator=g)
    mask = (i0 >= 0) & (i0 < shape[0]) & (i1 >= 0) & (i1 < shape[1])
    x = torch.randn(shape, generator=g, dtype=D)
    s = [data.draw(sbps_for(mesh, tuple(t.shape))) for t in (mask, i0, i1)]
    check(lambda x, m, i, j: torch.ops.aten._unsafe_masked_index(x, m, [i, j], -1.5),
          [x, mask, i0, i1], mesh, [sbp] + s)


def test_roll_of_a_split_dim_sends_only_the_rows_that_cross():
    """A ring shift: rolled by one row, each rank of 4 receives the one row (4 floats) its neighbour held,
    and the result keeps the split."""
    t = torch.arange(32.0).reshape(8, 4)

    def body():
        x = gt.to_global(t, mesh_placement((4,)), gt.split(0))
        with gt.comm_log() as log:
            y = torch.roll(x, 1, 0)
        return y.sbp, log.recv_bytes, y.full_tensor()
    for sbp, received, full in gt.launch(body, 4):
        assert sbp == (gt.split(0),) and received == 4 * 4
        assert torch.equal(full, torch.roll(t, 1, 0))


def test_repeat_of_a_split_dim_receives_only_the_rows_of_its_block():
    """[8] split over 4, repeated twice: rank k's block of the 16 is rows 4k..4k+3 mod 8, of which it holds
    two (ranks 0, 3) or none (ranks 1, 2): 2 or 4 floats received, not the 6 of a gather."""
    t = torch.arange(8.0)

    def body():
        x = gt.to_global(t, mesh_placement((4,)), gt.split(0))
        with gt.comm_log() as log:
            y = x.repeat(2)
        return y.sbp, log.recv_bytes, y.full_tensor()
    got = gt.launch(body, 4)
    assert [r[1] for r in got] == [8, 16, 16, 8]
    for sbp, _, full in got:
        assert sbp == (gt.split(0),) and torch.equal(full, t.repeat(2))
