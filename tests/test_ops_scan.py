"""cumsum / cumprod along a split dim as a distributed scan (ops/reduction.py `scan_local`): values equal
one device's (integers exactly, floats to rounding: the earlier shards' totals are added after the local
scan), the output keeps the split, and the only traffic is the all-gather of the shards' totals, one per
mesh axis that splits the dim (innermost first), each rank receiving n_a - 1 rows of its cross-section."""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from hypothesis import event, given, strategies as st

import globaltensor as gt
from ops_support import Mesh, check_outside, mesh_placement, meshes, world_of
from strategies import expected_shard

SCANS = {"cumsum": torch.cumsum, "cumprod": torch.cumprod}


def expected_events(p: gt.Placement, sbp: tuple, shape: tuple, dim: int, itemsize: int, rank: int) -> list:
    """The totals' all-gathers rank `rank` takes part in: per mesh axis splitting `dim` (innermost
    first), the other members' rows of this rank's cross-section of `dim`."""
    local = expected_shard(np.empty(shape), p, sbp, rank).shape
    row = math.prod(local[:dim] + local[dim + 1:])
    axes = [a for a, s in enumerate(sbp) if s == gt.split(dim) and p.shape[a] > 1]
    return [("all_gather", p.group(rank, a), (p.shape[a] - 1) * row * itemsize) for a in reversed(axes)]


def scanned(sbp: tuple, out_sbp: tuple, dim: int) -> bool:
    """Whether the output says the scan ran on the input's split of `dim`, its other axes as they were
    or Broadcast sliced for free (a smaller cross-section: fewer totals to exchange)."""
    return all(o == s or (s == gt.broadcast and isinstance(o, gt.Split) and o.dim != dim)
               for s, o in zip(sbp, out_sbp))


def run(name: str, x: torch.Tensor, dim: int, mesh: Mesh, sbp: tuple, grad: bool):
    def body():
        p = mesh_placement(mesh)
        gx = gt.to_global(x, p, sbp).requires_grad_(grad)
        with gt.comm_log() as log:
            y = SCANS[name](gx, dim)
        fwd = [(e.kind, e.group, e.recv_bytes) for e in log.events]
        g = None
        if grad:
            torch.manual_seed(3)
            w = torch.randn(x.shape, dtype=x.dtype)
            (y * w).sum().backward()
            g = gx.grad.full_tensor()
        outside = None
        if gt.rank() not in p.flat_ranks:
            outside = ([(tuple(y.shape), y.dtype, y._local.numel(), y._local.dtype)],
                       [(tuple(gx.grad.shape), gx.grad.dtype, gx.grad._local.numel(), gx.grad._local.dtype)]
                       if grad else [])
        return y.full_tensor(), g, y.sbp, fwd, outside
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gt.launch(body, world_of(mesh))


@given(meshes([(2,), (3,), (4,), (2, 2)]), st.lists(st.integers(0, 3), min_size=1, max_size=3),
       st.sampled_from(sorted(SCANS)), st.sampled_from([torch.int64, torch.float64]), st.data())
def test_scan_of_a_split_dim_matches_one_device(mesh, shape, name, dtype, data):
    """Any layout with the scanned dim split on some mesh axis (1-D or nested on 2x2, uneven, smaller
    than the mesh, empty), other axes random: one device's values, integers exact, and where the
    split is kept, exactly the totals' all-gathers."""
    dim = data.draw(st.integers(0, len(shape) - 1))
    # empty, smaller than the mesh, or long (where the scan is the cheapest)
    shape[dim] = data.draw(st.sampled_from([9, 14, 7, 12, 0, 1, 2, 3]))
    sbp = list(data.draw(st.tuples(*[st.sampled_from([gt.broadcast, gt.split(dim)] +
                                                     [gt.split(d) for d in range(len(shape))])] * len(mesh))))
    sbp[data.draw(st.integers(0, len(mesh) - 1))] = gt.split(dim)  # the scanned dim split somewhere
    sbp = tuple(sbp)
    torch.manual_seed(7)
    if dtype.is_floating_point:
        x = torch.rand(shape, dtype=dtype) + 0.5  # products neither vanish nor blow up
    else:
        x = torch.randint(-3, 4, shape, dtype=dtype)
    grad = dtype.is_floating_point
    want = SCANS[name](x, dim)
    want_grad = None
    if grad:
        xl = x.clone().requires_grad_()
        torch.manual_seed(3)
        (SCANS[name](xl, dim) * torch.randn(x.shape, dtype=dtype)).sum().backward()
        want_grad = xl.grad
    p = mesh_placement(mesh)
    for rank, (out, g, out_sbp, fwd, outside) in enumerate(run(name, x, dim, mesh, sbp, grad)):
        if outside is not None:
            check_outside(rank, outside, [want], [want_grad] if grad else [])
            assert fwd == []
            continue
        if dtype.is_floating_point:
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(g, want_grad)
        else:
            assert torch.equal(out, want)
        if scanned(sbp, out_sbp, dim):  # the scan kept the split: its totals are all that moved
            event("scanned")
            assert fwd == expected_events(p, out_sbp, tuple(shape), dim, want.dtype.itemsize, rank)


def test_the_scan_is_chosen_and_moves_only_the_totals():
    """Where the dim is long the scan is the cheapest (short, an all-to-all to another dim's split can
    cost less, and the cost model takes it): 1-D (uneven: 13 rows on 3 ranks), 2x2 split on either
    axis and nested on both, an int64 scan of a one-hot (the MoE capacity position) exact."""
    b, s0, s1 = gt.broadcast, gt.split(0), gt.split(1)
    cases = [(Mesh((3,)), (s0,), (13, 4), 0, (s0,)),
             (Mesh((2, 2)), (s1, b), (3, 17), 1, (s1, s0)),  # B sliced for free: a third of the totals
             (Mesh((2, 2)), (b, s1), (3, 17), 1, (s0, s1)),
             (Mesh((2, 2)), (gt.split(2), s0), (2, 3, 12), 2, (gt.split(2), s0)),
             (Mesh((2, 2)), (s0, s0), (21, 3), 0, (s0, s0))]
    torch.manual_seed(5)
    for mesh, sbp, shape, dim, scanned_in in cases:
        x = torch.nn.functional.one_hot(torch.randint(0, shape[-1], shape[:-1]), shape[-1]).to(torch.int64)
        for name in SCANS:
            p = mesh_placement(mesh)
            for rank, (out, _, out_sbp, fwd, _) in enumerate(run(name, x, dim, mesh, sbp, grad=False)):
                assert torch.equal(out, SCANS[name](x, dim)) and out_sbp == scanned_in, (name, mesh, sbp)
                assert fwd == expected_events(p, scanned_in, shape, dim, 8, rank), (name, mesh, sbp, fwd)
                assert fwd, "the dim is split: the totals must be exchanged"


def test_in_place_scans_keep_the_split():
    """x.cumsum_(d) / x.cumprod_(d) on a split d: the same scan, written into the target's shard."""
    def body():
        p = mesh_placement(Mesh((2, 2)))
        out = []
        for name in ("cumsum_", "cumprod_"):
            x = gt.to_global(torch.arange(1.0, 13.0).reshape(6, 2), p, (gt.split(0), gt.split(0)))
            with gt.comm_log() as log:
                getattr(x, name)(0)
            out.append((x.full_tensor(), x.sbp, [e.kind for e in log.events], log.recv_bytes))
        return out
    full = torch.arange(1.0, 13.0).reshape(6, 2)
    for (s, s_sbp, s_kinds, s_bytes), (c, c_sbp, c_kinds, c_bytes) in gt.launch(body, 4):
        torch.testing.assert_close(s, full.cumsum(0))
        torch.testing.assert_close(c, full.cumprod(0))
        assert s_sbp == c_sbp == (gt.split(0), gt.split(0))
        assert s_kinds == c_kinds == ["all_gather", "all_gather"] and s_bytes == c_bytes == 2 * 2 * 4


def test_cumsum_backward_along_a_split_dim():
    """torch's cumsum backward is flip, cumsum, flip of the gradient. A flip of a split dim may keep
    the split (the ranks exchange mirror rows, 24 B here) or convert first. The input is a leaf, whose
    gradient the optimizer reads in its layout (`ops/scope.grad_sink`): a Partial gradient owes only its
    reduction there, which the gradient bucket makes anyway, so the gradient's shards become Partial
    (zero-filled to the whole size, free) and the backward moves nothing; the reduction is the reader's.
    (Before the leaf was priced as its reader, the (6, 2) case moved its split to dim 1 with a 12 B
    all-to-all, and its reader converted it back.)"""
    def body():
        p = mesh_placement(Mesh((2,)))
        out = []
        for shape in ((6, 2), (6,)):
            x = gt.to_global(torch.arange(12.0)[:math.prod(shape)].reshape(shape), p, gt.split(0))
            x.requires_grad_()
            y = x.cumsum(0)
            g = gt.to_global(torch.ones(shape), p, gt.split(0))
            with gt.comm_log() as log:
                y.backward(g)
            out.append((x.grad.full_tensor(), [(e.kind, e.recv_bytes) for e in log.events], x.grad.sbp))
        return out
    for rank, ((g2, ev2, sbp2), (g1, ev1, sbp1)) in enumerate(gt.launch(body, 2)):
        torch.testing.assert_close(g2, torch.arange(6.0, 0, -1)[:, None].expand(6, 2))
        torch.testing.assert_close(g1, torch.arange(6.0, 0, -1))
        assert ev2 == [] and sbp2 == (gt.partial_sum,)
        assert ev1 == [] and sbp1 == (gt.partial_sum,)
