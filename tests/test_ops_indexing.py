"""gather/scatter/scatter_add, x[idx] (index.Tensor), index_put, index_select/index_add against one device:
forward values and gradients, any input nd-SBPs (index and values split too), uneven shapes, worlds
larger than the mesh; and the layouts that move nothing."""
from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import check, mesh_placement, meshes, sbps_for

aten = torch.ops.aten
D = torch.float64
sizes = st.integers(1, 5)


def unique_index(shape: tuple, dim: int, rows: int, seed: int) -> torch.Tensor:
    """An index of `shape` whose entries along `dim` are distinct rows of [0, rows) (overwrites then
    do not depend on the order of writes, which torch leaves unspecified)."""
    g = torch.Generator().manual_seed(seed)
    full = shape[:dim] + (rows,) + shape[dim + 1:]
    return torch.rand(full, generator=g).argsort(dim).narrow(dim, 0, shape[dim])


@st.composite
def along_dim_case(draw):
    """self, index (no larger than self off `dim`, any size along it up to self's) and src (index's shape: torch's
    scatter backward fails on one device for a larger src)."""
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(sizes, min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    ishape = tuple(draw(st.integers(1, s)) if draw(st.booleans()) else s for s in shape)
    sshape = ishape
    sbps = [draw(sbps_for(mesh, s, partial=partial)) for s, partial in ((shape, True), (ishape, False), (sshape, True))]
    return mesh, shape, dim, ishape, sshape, sbps, draw(st.integers(0, 9))


GATHER_SCATTER = {
    "gather": lambda x, i, s, dim: x.gather(dim, i) * 2,
    "scatter_add": lambda x, i, s, dim: x.scatter_add(dim, i, s),
    "scatter_add_": lambda x, i, s, dim: (x * 1).scatter_add_(dim, i, s),
    "scatter_src": lambda x, i, s, dim: x.scatter(dim, i, s),
    "scatter_zero": lambda x, i, s, dim: x.scatter(dim, i, 0.0) + s.sum(),
    "scatter_value": lambda x, i, s, dim: x.scatter(dim, i, 2.5) + s.sum(),
    "gather_scatter": lambda x, i, s, dim: torch.zeros_like(x).scatter_add(dim, i, x.gather(dim, i)),
}


@given(along_dim_case(), st.sampled_from(sorted(GATHER_SCATTER)))
def test_gather_scatter_match_one_device(case, name):
    mesh, shape, dim, ishape, sshape, sbps, seed = case
    torch.manual_seed(seed)
    x, src = torch.randn(shape, dtype=D), torch.randn(sshape, dtype=D)
    if name in ("scatter_src", "scatter_zero", "scatter_value"):
        index = unique_index(ishape, dim, shape[dim], seed)
    else:
        index = torch.randint(0, shape[dim], ishape)
    check(lambda x, i, s: GATHER_SCATTER[name](x, i, s, dim), [x, index, src], mesh, sbps)


@st.composite
def index_case(draw):
    """x of 3 dims, one or two index tensors (negative entries too) on some dims, values for index_put."""
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(sizes, min_size=3, max_size=3)))
    form = draw(st.sampled_from(["first", "middle", "two_adjacent", "two_apart"]))
    k = draw(st.integers(1, 4))
    ishapes = {"first": [(k,)], "middle": [(draw(st.integers(1, 3)), k)], "two_adjacent": [(k,), (k,)],
               "two_apart": [(draw(st.integers(1, 3)), 1), (k,)]}[form]
    sx = draw(sbps_for(mesh, shape, partial=True))
    sidx = [draw(sbps_for(mesh, s)) for s in ishapes]
    return mesh, shape, form, ishapes, sx, sidx, draw(st.integers(0, 9))


def _positions(form: str) -> list:
    return {"first": [0], "middle": [1], "two_adjacent": [0, 1], "two_apart": [0, 2]}[form]


def _indices(form: str, idx: list) -> list:
    """The aten `indices` list for the form (None for dims not indexed)."""
    out = [None, None, None]
    for p, t in zip(_positions(form), idx):
        out[p] = t
    return out[:max(_positions(form)) + 1]


def _index(rows: int, shape: tuple, g: torch.Generator, distinct: bool) -> torch.Tensor:
    """Entries in [-rows, rows) (negative ones count from the end); distinct rows if asked."""
    n = math.prod(shape)
    t = torch.randperm(rows, generator=g)[:n].reshape(shape) if distinct else torch.randint(0, rows, shape, generator=g)
    return t - rows * torch.randint(0, 2, shape, generator=g)


@given(index_case(), st.sampled_from(["read", "put", "put_acc", "put_acc_inplace"]), st.data())
def test_index_and_index_put_match_one_device(case, op, data):
    mesh, shape, form, ishapes, sx, sidx, seed = case
    pos = _positions(form)
    if op == "put" and any(math.prod(s) > shape[p] for p, s in zip(pos, ishapes)):
        op = "put_acc"  # an overwrite needs distinct targets (torch leaves the order of writes unspecified)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, dtype=D, generator=g)
    idx = [_index(shape[p], s, g, op == "put") for p, s in zip(pos, ishapes)]
    result = tuple(aten.index.Tensor(x, _indices(form, idx)).shape)
    vshape = result[data.draw(st.integers(0, len(result) - 1)):]  # values broadcast to x[indices]
    values = torch.randn(vshape, dtype=D, generator=g)
    sv = data.draw(sbps_for(mesh, vshape, partial=True))
    n = len(idx)

    def fn(x, *rest):
        ind, v = _indices(form, list(rest[:n])), rest[n]
        if op == "read":
            return x[tuple(slice(None) if t is None else t for t in ind)] * 3 + v.sum()  # x[:, idx] & co.
        if op == "put":
            return aten.index_put.default(x, ind, v, False)
        if op == "put_acc":
            return aten.index_put.default(x, ind, v * 2, True)
        y = x * 1
        aten.index_put_.default(y, ind, v, True)
        return y
    check(fn, [x] + idx + [values], mesh, [sx] + sidx + [sv])


@st.composite
def select_case(draw):
    mesh = draw(meshes())
    shape = tuple(draw(st.lists(sizes, min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    k = draw(st.integers(1, 5))
    sshape = shape[:dim] + (k,) + shape[dim + 1:]
    sbps = [draw(sbps_for(mesh, shape, partial=True)), draw(sbps_for(mesh, (k,))),
            draw(sbps_for(mesh, sshape, partial=True))]
    return mesh, shape, dim, k, sshape, sbps, draw(st.integers(0, 9))


@given(select_case(), st.sampled_from(["index_select", "index_add", "index_add_"]))
def test_index_select_and_add_match_one_device(case, name):
    mesh, shape, dim, k, sshape, sbps, seed = case
    torch.manual_seed(seed)
    x, src = torch.randn(shape, dtype=D), torch.randn(sshape, dtype=D)
    index = torch.randint(0, shape[dim], (k,))
    fns = {"index_select": lambda x, i, s: x.index_select(dim, i) * s,
           "index_add": lambda x, i, s: x.index_add(dim, i, s, alpha=2),
           "index_add_": lambda x, i, s: (x * 1).index_add_(dim, i, s)}
    check(fns[name], [x, index, src], mesh, sbps)


def test_reads_and_writes_of_a_split_table_move_nothing():
    """Split along the dim addressed by value: reads give P, writes stay split; nothing is received
    (a large table and a few entries: the reads' later reduction is cheaper than moving the table)."""
    t = torch.arange(256.0).reshape(64, 4)
    rows = torch.tensor([63, 0, 33, 33])

    def body():
        p = mesh_placement((2,))
        w = gt.to_global(t, p, gt.split(0))
        idx = gt.to_global(rows, p, gt.broadcast)
        with gt.comm_log() as log:
            read = w[idx]
            put = w.index_put((idx,), torch.ones(4, 4), accumulate=True)
            col = w.gather(0, idx.reshape(4, 1).expand(4, 4))
            added = w.scatter_add(0, idx.reshape(4, 1).expand(4, 4), torch.ones(4, 4))
            picked = w.index_select(0, idx)
        outs = (read, put, col, added, picked)
        return [o.sbp for o in outs], log.recv_bytes, [o.full_tensor() for o in outs]
    sbps, received, fulls = gt.launch(body, 2)[0]
    P, S0 = (gt.partial_sum,), (gt.split(0),)
    assert sbps == [P, S0, P, S0, P] and received == 0
    added = t.index_put((rows,), torch.ones(4, 4), accumulate=True)
    for got, want in zip(fulls, (t[rows], added, t[rows], added, t[rows])):
        assert torch.equal(got, want)


def test_split_index_splits_the_output_and_its_gradient_stays_partial():
    """Many lookups into a small table: the lookup moves nothing, and the table's gradient is each rank's
    additions (P), cheaper to reduce later than gathering the lookups' gradient."""
    rows = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(0))

    def body():
        p = mesh_placement((2,))
        x = gt.to_global(torch.ones(3, 2), p, gt.broadcast).requires_grad_()
        idx = gt.to_global(rows, p, gt.split(0))
        with gt.comm_log() as log:
            y = x[idx]
        forward = log.recv_bytes
        (y * 2).sum().backward()
        return y.sbp, x.grad.sbp, forward, x.grad.full_tensor()
    ysbp, gsbp, received, grad = gt.launch(body, 2)[0]
    assert ysbp == (gt.split(0),) and gsbp == (gt.partial_sum,) and received == 0
    assert torch.equal(grad, torch.zeros(3, 2).index_put((rows,), torch.full((16, 2), 2.0), accumulate=True))


def test_ranks_outside_get_empty_shards():
    def body():
        p = gt.placement("cpu", [2, 0])
        w = gt.to_global(torch.arange(12.0).reshape(6, 2), p, gt.split(0))
        idx = gt.to_global(torch.tensor([5, 0, 3]), p, gt.broadcast)
        outs = (w[idx], w.gather(0, idx.reshape(3, 1).expand(3, 2)), w.index_select(0, idx))
        return [(o.shape, o._local.numel(), o.dtype) for o in outs]
    got = gt.launch(body, 3)
    assert all(n == 0 for _, n, _ in got[1]) and all(n > 0 for _, n, _ in got[0])
    assert [s for s, _, _ in got[1]] == [s for s, _, _ in got[0]]
