"""View ops: splits travel through dim maps (reshape groups included); what cannot travel is boxed and counted."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import check, meshes, mesh_placement, sbps_for

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
