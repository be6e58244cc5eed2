"""Batched linear algebra on global tensors (ops/linalg.py): a split of a batch dim passes through every
factorization, decomposition and solve, values and gradients equal to one device's, nothing gathered and
nothing sent; a solve's right-hand side split by columns (or Partial) with the matrix whole stays so; the
errors torch raises from an `info` name the same batch element as on one device."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from ops_support import check, mesh_placement, meshes

D = torch.float64
LINALG_ATEN = {  # the aten ops ops/linalg.py gives rules; none of them may run replicated here
    "linalg_inv_ex", "linalg_cholesky_ex", "linalg_solve_triangular", "_linalg_solve_ex", "linalg_lu",
    "linalg_lu_factor_ex", "linalg_lu_solve", "lu_unpack", "_linalg_svd", "_linalg_eigh", "linalg_eig",
    "linalg_qr", "_linalg_det", "_linalg_slogdet", "linalg_pinv", "linalg_matrix_exp", "linalg_ldl_factor_ex",
    "linalg_ldl_solve", "linalg_cross", "cholesky", "cholesky_inverse", "cholesky_solve", "triangular_solve",
    "geqrf", "_linalg_check_errors"}


def _general(g, batch, n):
    """Well conditioned: a random matrix plus n on the diagonal."""
    return torch.randn(*batch, n, n, dtype=D, generator=g) + n * torch.eye(n, dtype=D)


def _spd(g, batch, n):
    m = torch.randn(*batch, n, n, dtype=D, generator=g)
    return m @ m.mT + n * torch.eye(n, dtype=D)


def _upper(g, batch, n):
    return torch.triu(_general(g, batch, n))


def _rhs(g, batch, n, k=2):
    return torch.randn(*batch, n, k, dtype=D, generator=g)


# name -> (function of global or plain tensors, input makers (generator, batch, n), gradients checked)
OPS = {
    "inv": (torch.linalg.inv, [_general], True),
    "cholesky": (torch.linalg.cholesky, [_spd], True),
    "cholesky_ex": (lambda a: torch.linalg.cholesky_ex(a, upper=True), [_spd], True),
    "solve": (torch.linalg.solve, [_general, _rhs], True),
    "solve_vector": (lambda a, b: torch.linalg.solve(a, b[..., 0]), [_general, _rhs], True),
    "solve_right": (lambda a, b: torch.linalg.solve(a, b.mT, left=False), [_general, _rhs], True),
    "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), [_upper, _rhs], True),
    "lu_factor_solve": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), [_general, _rhs], True),
    "lu": (torch.linalg.lu, [_general], True),
    "lu_unpack": (lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)), [_general], True),
    "svd": (lambda a: torch.linalg.svd(a, full_matrices=False), [_general], True),
    "svdvals": (torch.linalg.svdvals, [_general], True),
    "eigh": (torch.linalg.eigh, [_spd], True),
    "eigvals": (lambda a: torch.linalg.eigvals(a).abs(), [_general], True),
    "eig": (lambda a: (torch.view_as_real(torch.linalg.eig(a)[0]), torch.linalg.eig(a)[1].abs()), [_spd], True),
    "qr": (torch.linalg.qr, [_general], True),
    "det": (torch.linalg.det, [_general], True),
    "slogdet": (torch.linalg.slogdet, [_general], True),
    "logdet": (torch.logdet, [_spd], True),
    "pinv": (torch.linalg.pinv, [_general], True),
    "matrix_exp": (lambda a: torch.linalg.matrix_exp(a / a.shape[-1]), [_general], True),
    "ldl": (lambda a, b: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a), b), [_spd, _rhs], False),
    "cholesky_solve": (lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a)), [_spd, _rhs], True),
    "cholesky_inverse": (lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), [_spd], True),
    # (its cloned coefficient left out: the gradient torch gives B from it alone is a plain zeros tensor)
    "triangular_solve": (lambda a, b: torch.triangular_solve(b, a)[0], [_upper, _rhs], True),
    "geqrf": (torch.geqrf, [_general], False),
}


def _singular_values(a: torch.Tensor) -> torch.Tensor:
    """svd without U and V (compute_uv=False), the form whose batch splits (torch's svdvals asks for U and V
    whenever its input is a tensor subclass, so it runs whole here)."""
    return torch.ops.aten._linalg_svd(a, False, False)[1]


def _eigenvalues(a: torch.Tensor) -> torch.Tensor:
    """eigh without eigenvectors (compute_v=False), likewise."""
    return torch.ops.aten._linalg_eigh(a, "L", False)[0]


EXTRA = {"singular_values": (_singular_values, [_general], False), "eigenvalues": (_eigenvalues, [_spd], False)}


def _fallen() -> set:
    return {k.removeprefix("aten.").split(".")[0] for k in gt.stats()["fallback"]} & LINALG_ATEN


@settings(max_examples=2)
@pytest.mark.parametrize("name", sorted(OPS))
@given(mesh=meshes([(2,), (3,), (4,), (2, 2)]),
       batch=st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=1, max_size=2), n=st.integers(1, 3), data=st.data())
def test_batch_split_equals_one_device(name, mesh, batch, n, data):
    """Any batch (empty and uneven shards included), the first input's batch split on mesh axis 0 and every
    other choice random (a batch dim or Broadcast, per input and axis): values equal one device's, and
    gradients too, of all the outputs or of one alone (a backward may take another path when some
    outputs get no gradient), and no linalg op runs replicated."""
    fn, makers, grad = OPS[name]
    g = torch.Generator().manual_seed(len(batch) * 10 + n)
    inputs = [make(g, batch, n) for make in makers]
    choices = [gt.broadcast] + [gt.split(d) for d in range(len(batch))]
    sbps = [tuple(data.draw(st.sampled_from(choices)) for _ in mesh) for _ in inputs]
    sbps[0] = (gt.split(data.draw(st.integers(0, len(batch) - 1))),) + sbps[0][1:]
    outs = fn(*inputs)
    if isinstance(outs, (tuple, list)):
        which = data.draw(st.sampled_from([None] + [k for k, o in enumerate(outs) if o.is_floating_point()]))
        if which is not None:
            fn = (lambda f, k: lambda *xs: f(*xs)[k])(fn, which)
    gt.reset_stats()
    check(fn, inputs, mesh, sbps, grad=grad, rtol=1e-7, atol=1e-9)
    assert not _fallen(), gt.stats()["fallback"]


def _forward(fn, inputs: list, sbps: list, world: int = 4):
    """fn on GlobalTensors laid out as `sbps` over 1-D mesh of `world`: (outputs full, outputs' SBPs, what
    the call itself sent) on rank 0."""
    def body():
        p = mesh_placement((world,))
        xs = [gt.to_global(t, p, s) for t, s in zip(inputs, sbps)]
        with gt.comm_log() as log:
            out = fn(*xs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o.full_tensor() for o in outs], [o.sbp for o in outs], [(e.kind, e.recv_bytes) for e in log.events]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gt.launch(body, world)[0]


@pytest.mark.parametrize("name", ["inv", "cholesky", "solve", "lu", "singular_values", "eigenvalues", "qr",
                                  "slogdet", "pinv", "matrix_exp", "geqrf", "lu_factor_solve"])
def test_shared_batch_split_stays_and_sends_nothing(name):
    """Every input split alike on the batch: each rank computes its own matrices, the outputs keep the split
    (info, pivots, eigenvalues, determinants too) and the call sends nothing at all. (svd with U and V, eigh with
    eigenvectors and eig run whole: see ops/linalg.py.)"""
    fn, makers, _ = OPS[name] if name in OPS else EXTRA[name]
    g = torch.Generator().manual_seed(3)
    inputs = [make(g, (6,), 3) for make in makers]
    want = fn(*inputs)
    want = want if isinstance(want, (tuple, list)) else (want,)
    gt.reset_stats()
    outs, sbps, sent = _forward(fn, inputs, [gt.split(0)] * len(inputs))
    for o, w in zip(outs, want):
        torch.testing.assert_close(o, w, rtol=1e-7, atol=1e-9)
    assert all(s == (gt.split(0),) for s in sbps), sbps
    assert sent == []
    assert not _fallen()


@pytest.mark.parametrize("name,fn", [
    ("solve", lambda a, b: torch.linalg.solve(a, b)),
    ("solve_ex", lambda a, b: torch.linalg.solve_ex(a, b)[0]),
    ("solve_triangular", lambda a, b: torch.linalg.solve_triangular(torch.triu(a), b, upper=True)),
    ("lu_solve", lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b)),
    ("cholesky_solve", lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a @ a.mT))),
    ("triangular_solve", lambda a, b: torch.triangular_solve(b, torch.triu(a))[0]),
    ("ldl_solve", lambda a, b: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a @ a.mT), b)),
])
def test_right_hand_side_split_by_columns_or_partial(name, fn):
    """Model parallel solves: A whole, B's columns split -> X's columns split; B Partial -> X Partial. The
    solve itself sends nothing either way (the factorization of the whole A runs on every rank)."""
    g = torch.Generator().manual_seed(5)
    a, b = _general(g, (), 4), _rhs(g, (), 4, 7)
    want = fn(a, b)
    for sbp, expect in ((gt.split(1), (gt.split(1),)), (gt.partial_sum, (gt.partial_sum,))):
        gt.reset_stats()
        (out,), (got,), sent = _forward(lambda x, y: fn(x, y), [a, b], [gt.broadcast, sbp])
        torch.testing.assert_close(out, want, rtol=1e-7, atol=1e-9)
        assert got == expect, (name, sbp, got)
        assert [s for s in sent if s[1]] == []
        assert not _fallen()


def test_solve_right_form_splits_rows():
    """X A = B solves each row of B apart: B S(0) with A whole gives X S(0)."""
    g = torch.Generator().manual_seed(6)
    a, b = _general(g, (), 3), torch.randn(7, 3, dtype=D, generator=g)
    (out,), (sbp,), sent = _forward(lambda x, y: torch.linalg.solve(x, y, left=False), [a, b],
                                    [gt.broadcast, gt.split(0)])
    torch.testing.assert_close(out, torch.linalg.solve(a, b, left=False), rtol=1e-7, atol=1e-9)
    assert sbp == (gt.split(0),) and [s for s in sent if s[1]] == []


def test_cross_splits_every_other_dim_and_is_bilinear():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(5, 3, 4, dtype=D, generator=g), torch.randn(5, 3, 4, dtype=D, generator=g)
    for sbps in ([gt.split(0), gt.split(0)], [gt.split(2), gt.split(2)], [gt.split(0), gt.broadcast],
                 [gt.partial_sum, gt.broadcast]):
        check(lambda a, b: torch.linalg.cross(a, b, dim=1), [x, y], (4,), [(s,) for s in sbps], rtol=1e-7, atol=1e-9)
    (out,), (sbp,), sent = _forward(lambda a, b: torch.linalg.cross(a, b, dim=1), [x, y], [gt.split(2)] * 2)
    assert sbp == (gt.split(2),) and sent == []


def _not_pd(a: torch.Tensor, bad: int) -> torch.Tensor:
    a = a.clone()
    a[bad, 0, 0] = -1.0
    return a


def _singular(a: torch.Tensor, bad: int) -> torch.Tensor:
    a = a.clone()
    a[bad] = 0.0
    return a


RAISING = {  # name -> (function, how the bad matrix is made)
    "linalg.cholesky": (torch.linalg.cholesky, _not_pd),
    "cholesky": (torch.cholesky, _not_pd),  # its kernel checks its info itself
    "cholesky_ex_checked": (lambda a: torch.linalg.cholesky_ex(a, check_errors=True).L, _not_pd),
    "inv": (torch.linalg.inv, _singular),
    "solve": (lambda a: torch.linalg.solve(a, a[..., :1]), _singular),
    "lu_factor": (lambda a: torch.linalg.lu_factor(a).LU, _singular),
}


@pytest.mark.parametrize("name", sorted(RAISING))
@pytest.mark.parametrize("world,bad", [(4, 5), (3, 0), (2, 7)])
def test_errors_name_the_global_batch_element(name, world, bad):
    """A batch split over ranks, one matrix not positive definite (singular): the same error as one device,
    naming that matrix's global index, raised by the rank that holds it (the others send nothing)."""
    fn, spoil = RAISING[name]
    g = torch.Generator().manual_seed(8)
    a = spoil(_spd(g, (8,), 3), bad)
    with pytest.raises(RuntimeError) as one:  # LinAlgError, or RuntimeError (lu_factor's)
        fn(a)

    def body():
        p = mesh_placement((world,))
        return fn(gt.to_global(a, p, gt.split(0))).full_tensor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError) as ours:
            gt.launch(body, world)
    assert f"(Batch element {bad})" in str(one.value)
    assert type(ours.value) is type(one.value) and str(one.value) in str(ours.value)


def test_error_index_on_a_2d_batch_split_on_its_second_dim():
    """A (2, 6) batch split on dim 1 over 3 ranks: the failing matrix (1, 4) is global element 10."""
    g = torch.Generator().manual_seed(12)
    a = _spd(g, (2, 6), 3)
    a[1, 4, 0, 0] = -1.0
    with pytest.raises(torch.linalg.LinAlgError) as one:
        torch.linalg.cholesky(a)

    def body():
        return torch.linalg.cholesky(gt.to_global(a, mesh_placement((3,)), gt.split(1))).full_tensor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch.linalg.LinAlgError) as ours:
            gt.launch(body, 3)
    assert "(Batch element 10)" in str(one.value) and str(one.value) in str(ours.value)


def test_info_values_at_their_global_places():
    """cholesky_ex's info is data: split with the batch, each code where one device has it."""
    g = torch.Generator().manual_seed(9)
    a = _spd(g, (2, 5), 3)
    a[1, 3, 1, 1] = -50.0
    a[0, 0, 0, 0] = -1.0
    want = torch.linalg.cholesky_ex(a).info
    for sbp in ((gt.split(1),), (gt.split(0), gt.split(1))):
        mesh = (3,) if len(sbp) == 1 else (2, 2)
        check(lambda x: torch.linalg.cholesky_ex(x).info, [a], mesh, [sbp], grad=False)
    assert want.tolist() == [[1, 0, 0, 0, 0], [0, 0, 0, 2, 0]]


def test_lstsq_falls_back_and_equals_one_device():
    """linalg_lstsq keeps the replicated fallback (no meta kernel; its residuals' shape is the values'
    call): still one device's values."""
    g = torch.Generator().manual_seed(10)
    a, b = torch.randn(4, 5, 3, dtype=D, generator=g), torch.randn(4, 5, 2, dtype=D, generator=g)
    check(lambda x, y: torch.linalg.lstsq(x, y).solution, [a, b], (2,), [(gt.split(0),), (gt.split(0),)],
          rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("world", [2, 4])
def test_outside_ranks_hold_empty_shards(world):
    """A world larger than the placement: the ranks outside get empty shards of the right shapes and dtypes
    (pivots and info are int32) and compute nothing."""
    g = torch.Generator().manual_seed(11)
    a = _general(g, (5,), 3)

    def body():
        p = gt.placement("cpu", [1])
        lu, piv, info = torch.linalg.lu_factor_ex(gt.to_global(a, p, gt.split(0)))
        return [(tuple(t.shape), t.dtype, t._local.numel()) for t in (lu, piv, info)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = gt.launch(body, world)
    want = [(tuple(t.shape), t.dtype) for t in torch.linalg.lu_factor_ex(a)]
    for rank, held in enumerate(got):
        assert [h[:2] for h in held] == want
        assert rank == 1 or all(h[2] == 0 for h in held)


def test_pinv_tolerance_tensor_follows_the_batch():
    """pinv's atol as a tensor is per matrix: split with the batch dim it matches, or whole."""
    g = torch.Generator().manual_seed(13)
    a, tol = torch.randn(4, 3, 5, 3, dtype=D, generator=g), torch.rand(3, dtype=D, generator=g)
    cases = ((((gt.split(1),), (gt.split(0),)), (gt.split(1),)), (((gt.split(0),), (gt.broadcast,)), (gt.split(0),)))
    for sbps, want in cases:
        gt.reset_stats()
        got = check(lambda x, t: torch.linalg.pinv(x, atol=t.detach()), [a, tol], (2,), list(sbps),
                    rtol=1e-7, atol=1e-9)
        assert got == [want] and not _fallen()
