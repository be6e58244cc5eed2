"""Issue 17 item 2: Python values, truth reductions, equality, variance, data-dependent ops, boolean masks
and batch norm have rules: right values, no fallback, and no more communication than the value needs."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import check, meshes, sbps_for

D = torch.float64


def _no_fallback_on(fn, world=2):
    """fn() on every rank with warnings as errors; returns per-rank (result, fallbacks). The filter is set around
    the launch, in this thread: `catch_warnings` swaps the process-wide filter list, so the simulated ranks'
    threads entering it at once could each restore another's list and leave "error" behind."""
    def body():
        gt.reset_stats()
        return fn(), gt.stats()["fallback"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = gt.launch(body, world)
    for _, fallbacks in results:
        assert fallbacks == {}, fallbacks
    return [r for r, _ in results]


# -- .item(), float(), bool(), int() ------------------------------------------------------------------
def test_python_values_of_broadcast_partial_and_split():
    def fn():
        mesh = gt.placement("cpu", [0, 1])
        b = gt.to_global(torch.tensor(3.0), mesh, gt.broadcast)
        p = gt.from_local(torch.tensor(1.5), mesh, gt.partial_sum)
        s = gt.to_global(torch.arange(6.0), mesh, gt.split(0))
        with gt.comm_log() as free:
            vb = b.item()
        with gt.comm_log() as reduced:
            vp = float(p)
        return vb, vp, int(s.sum()), bool(s.sum() > 10), bool(s.max() == 5), free.recv_bytes, reduced.recv_bytes
    for vb, vp, total, big, top, free, reduced in _no_fallback_on(fn):
        assert (vb, vp, total, big, top) == (3.0, 3.0, 15, True, True)
        assert free == 0 and 0 < reduced <= 8  # Broadcast: nothing; Partial: one element all-reduced


def _item_outside():
    x = gt.to_global(torch.tensor(1.0), gt.placement("cpu", [0]), gt.broadcast)
    return x.item()


def test_item_on_a_rank_outside_the_placement_says_so():
    with pytest.raises(ValueError, match="outside the placement"):
        gt.launch(_item_outside, 2)


# -- any / all ------------------------------------------------------------------------------------------
ANY_ALL = {"any": lambda t, d, k: t.any(), "all": lambda t, d, k: t.all(),
           "any_dim": lambda t, d, k: t.any(d, keepdim=k), "all_dim": lambda t, d, k: t.all(d, keepdim=k)}


@given(meshes(), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.sampled_from(sorted(ANY_ALL)),
       st.booleans(), st.floats(0.0, 1.0), st.data())
def test_any_all_match_one_device(mesh, shape, name, keep, density, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    sbp = data.draw(sbps_for(mesh, tuple(shape)))
    torch.manual_seed(3)
    x = torch.rand(shape) < density
    check(lambda t: ANY_ALL[name](t, dim, keep), [x], mesh, [sbp], grad=False)


def test_any_of_a_split_tensor_reduces_one_byte():
    def fn():
        mesh = gt.placement("cpu", [0, 1, 2, 3])
        x = gt.to_global(torch.arange(1000.0), mesh, gt.split(0))
        with gt.comm_log() as log:
            hit, every = bool((x > 998).any()), bool((x >= 0).all())
        return hit, every, log.recv_bytes
    for hit, every, received in _no_fallback_on(fn, 4):
        assert hit and every and received <= 8  # two one-byte all-reduces (gathering x: 3,000 bytes)


# -- torch.equal ----------------------------------------------------------------------------------------
def test_equal_compares_shards_where_they_are():
    def fn():
        mesh = gt.placement("cpu", [[0, 1], [2, 3]])
        t = torch.arange(64.0).reshape(8, 8)
        a = gt.to_global(t, mesh, (gt.split(0), gt.split(1)))
        b = gt.to_global(t, mesh, (gt.split(0), gt.split(1)))
        c = gt.to_global(t.clone().index_fill_(0, torch.tensor([7]), -1.0), mesh, (gt.split(0), gt.split(1)))
        with gt.comm_log() as log:
            same, differ = torch.equal(a, b), torch.equal(a, c)
        return same, differ, torch.equal(a, gt.to_global(t[:4], mesh, (gt.split(0), gt.split(1)))), log.recv_bytes
    for same, differ, other_shape, received in _no_fallback_on(fn, 4):
        assert same is True and differ is False and other_shape is False
        assert received < 64 * 4 / 4  # far less than gathering one tensor's 3/4 of 256 bytes


# -- var / std --------------------------------------------------------------------------------------------
VAR = {"var": lambda t, d, k, c: t.var(d, keepdim=k, correction=c),
       "std": lambda t, d, k, c: t.std(d, keepdim=k, correction=c),
       "var_all": lambda t, d, k, c: t.var(), "std_unbiased_false": lambda t, d, k, c: t.std(d, False, keepdim=k),
       "var_mean": lambda t, d, k, c: torch.var_mean(t, d, keepdim=k, correction=c),
       "std_mean": lambda t, d, k, c: torch.std_mean(t, d, keepdim=k, correction=c)}


@given(meshes(), st.lists(st.integers(2, 5), min_size=1, max_size=3), st.sampled_from(sorted(VAR)),
       st.booleans(), st.sampled_from([0, 1]), st.data())
def test_variance_matches_one_device(mesh, shape, name, keep, correction, data):
    dims = sorted(set(data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=2))))
    sbp = data.draw(sbps_for(mesh, tuple(shape), partial=True))
    torch.manual_seed(4)
    x = torch.randn(shape, dtype=D)
    check(lambda t: VAR[name](t, dims, keep, correction), [x], mesh, [sbp])


def test_variance_over_a_split_dim_moves_only_reductions():
    def fn():
        mesh = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.randn(64, 8), mesh, gt.split(0))
        with gt.comm_log() as log:
            x.var(0).full_tensor()
        return log.recv_bytes
    for received in _no_fallback_on(fn):
        assert received <= 4 * 8 * 4  # [8]-sized reductions, never the [64, 8] input


# -- data-dependent shapes: unique, nonzero, masked_select, x[mask] ----------------------------------------
DATA_DEPENDENT = {
    "unique": lambda t: torch.unique(t.round()), "unique_counts": lambda t: torch.unique(t.round(), return_counts=True),
    "nonzero": lambda t: (t > 0).nonzero(), "masked_select": lambda t: torch.masked_select(t, t > 0),
    "mask": lambda t: t[t > 0], "row_mask": lambda t: t[t[..., 0] > 0] if t.dim() > 1 else t[t > 0],
}


@given(meshes(), st.lists(st.integers(1, 5), min_size=1, max_size=2), st.sampled_from(sorted(DATA_DEPENDENT)),
       st.data())
def test_data_dependent_ops_match_one_device(mesh, shape, name, data):
    sbp = data.draw(sbps_for(mesh, tuple(shape), partial=True))
    torch.manual_seed(5)
    x = torch.randn(shape, dtype=D)
    check(DATA_DEPENDENT[name], [x], mesh, [sbp], grad=name in ("mask", "row_mask", "masked_select"))


def test_data_dependent_results_are_broadcast_and_a_mask_index_keeps_x_in_place():
    def fn():
        mesh = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.arange(12.0).reshape(6, 2), mesh, gt.split(1))
        u, nz = torch.unique(x), x.nonzero()
        rows = gt.to_global(torch.tensor([True, False, True, True, False, False]), mesh, gt.broadcast)
        picked = x[rows]
        x[rows] = 0.0
        return u.sbp, nz.sbp, picked.sbp, picked.full_tensor(), x.full_tensor()[:, 0].tolist()
    for u, nz, picked_sbp, picked, col in _no_fallback_on(fn):
        assert u == nz == (gt.broadcast,) and picked_sbp == (gt.split(1),)  # x split off the mask: stays
        assert torch.equal(picked, torch.tensor([[0.0, 1.0], [4.0, 5.0], [6.0, 7.0]]))
        assert col == [0.0, 2.0, 0.0, 0.0, 8.0, 10.0]


# -- batch norm ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("sbp", [gt.split(0), gt.split(1), gt.split(2), gt.broadcast, gt.partial_sum])
def test_batch_norm_matches_one_device_with_running_statistics(sbp, train):
    def fn():
        torch.manual_seed(0)
        m = torch.nn.BatchNorm1d(3).train(train)
        ref = torch.nn.BatchNorm1d(3).train(train)
        ref.load_state_dict(m.state_dict())
        mesh = gt.placement("cpu", [0, 1])
        gt.to_global(m, mesh, {"weight": gt.broadcast})
        x = torch.randn(5, 3, 4)
        xg = gt.to_global(x, mesh, sbp).requires_grad_()
        xr = x.clone().requires_grad_()
        for _ in range(2):
            (m(xg) ** 2).sum().backward()
            (ref(xr) ** 2).sum().backward()
        y = m(xg)
        torch.testing.assert_close(y.full_tensor(), ref(xr).detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(xg.grad.full_tensor(), xr.grad, atol=1e-4, rtol=1e-4)
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(m, name).grad.full_tensor(), getattr(ref, name).grad,
                                       atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(m.running_mean.full_tensor(), ref.running_mean)
        torch.testing.assert_close(m.running_var.full_tensor(), ref.running_var)
        return y.sbp
    for out_sbp in _no_fallback_on(fn):
        if sbp != gt.partial_sum:
            assert out_sbp == (sbp,)  # the activation stays where it is


def test_batch_norm_of_a_split_batch_moves_only_channel_statistics():
    def fn():
        mesh = gt.placement("cpu", [0, 1])
        m = gt.to_global(torch.nn.BatchNorm2d(4), mesh, {})
        x = gt.to_global(torch.randn(8, 4, 6, 6), mesh, gt.split(0))
        with gt.comm_log() as log:
            m(x)
        return log.recv_bytes
    for received in _no_fallback_on(fn):
        assert received <= 4 * 4 * 4  # two [4]-sized all-reduces (and the running stats stay B)


@pytest.mark.parametrize("shape,sbp", [((1, 1), (gt.split(0), gt.broadcast)), ((4,), (gt.split(0), gt.broadcast)),
                                       ((5, 3), (gt.split(1), gt.split(0)))])
def test_mask_index_backward_and_mask_assignment(shape, sbp):
    """x[mask]'s backward is index_put with the mask (which has a meta kernel): decomposed too."""
    torch.manual_seed(6)
    x = torch.randn(shape, dtype=D)
    for name in ("mask", "row_mask"):
        check(DATA_DEPENDENT[name], [x], (1, 2), [sbp])

    def assign(t):
        t = t * 1
        t[t > 0] = 0.5
        return t
    check(assign, [x], (2, 2), [sbp])


@given(meshes(), st.lists(st.integers(1, 4), min_size=2, max_size=4), st.booleans(), st.data())
def test_batch_norm_function_matches_one_device(mesh, shape, train, data):
    """F.batch_norm on any layout of input, weight and bias (plain running statistics in eval)."""
    c = shape[1]
    sbps = [data.draw(sbps_for(mesh, tuple(shape), partial=True))] + \
        [data.draw(sbps_for(mesh, (c,))) for _ in range(2)]
    torch.manual_seed(8)
    x, w, b = torch.randn(shape, dtype=D), torch.randn(c, dtype=D), torch.randn(c, dtype=D)
    if train and shape[0] * (int(torch.tensor(shape[2:]).prod()) if len(shape) > 2 else 1) < 2:
        shape[0] += 1  # torch refuses training statistics over one value per channel
        x = torch.randn(shape, dtype=D)
    rm, rv = torch.randn(c, dtype=D), torch.rand(c, dtype=D) + 0.5
    check(lambda t, w_, b_: F.batch_norm(t, None if train else rm, None if train else rv, w_, b_, training=train),
          [x, w, b], mesh, sbps, atol=1e-6, rtol=1e-6)
