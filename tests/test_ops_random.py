"""Random ops and factories give the single-device values whatever the mesh and SBP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import meshes, mesh_placement, sbps_for, world_of


def _held(t):
    """The whole value (empty on a rank outside the placement) and how many elements this rank holds."""
    return t.full_tensor(), t._local.numel()


@given(meshes(), st.data())
def test_dropout_and_random_like_are_layout_independent(mesh, data):
    shape = (5, 3)
    sbp = data.draw(sbps_for(mesh, shape))
    x = torch.randn(shape)
    torch.manual_seed(7)
    want = (F.dropout(x, 0.5), torch.rand_like(x), torch.empty(4, 3).normal_())

    def body():
        p = mesh_placement(mesh)
        g = gt.to_global(x, p, sbp)
        torch.manual_seed(7)
        d, r = F.dropout(g, 0.5), torch.rand_like(g)
        n = gt.to_global(torch.empty(4, 3), p, sbp if all(not isinstance(s, gt.Split) or s.dim < 2 for s in sbp)
                         else gt.broadcast).normal_()
        return gt.rank() in p.flat_ranks, [_held(t) for t in (d, r, n)]
    for inside, got in gt.launch(body, world_of(mesh)):
        for (full, numel), b in zip(got, want):
            assert torch.equal(full, b) if inside else numel == 0 and full.numel() == 0 and full.dtype == b.dtype


@given(meshes(), st.data())
def test_factories(mesh, data):
    sbp = data.draw(sbps_for(mesh, (6, 5), partial=True))
    torch.manual_seed(8)
    want = torch.randn(6, 5)

    def body():
        p = mesh_placement(mesh)
        torch.manual_seed(8)
        r = gt.randn(6, 5, placement=p, sbp=sbp)
        z, o = gt.zeros(6, 5, placement=p, sbp=sbp), gt.ones((6, 5), placement=p, sbp=sbp)
        return gt.rank() in p.flat_ranks, [_held(t) for t in (r, z, o, torch.ones_like(r))]
    for inside, got in gt.launch(body, world_of(mesh)):
        for (full, numel), b in zip(got, (want, torch.zeros(6, 5), torch.ones(6, 5), torch.ones(6, 5))):
            assert torch.equal(full, b) if inside else numel == 0 and full.numel() == 0 and full.dtype == b.dtype


@given(meshes(), st.data())
def test_new_of_its_own_size_keeps_the_layout_and_moves_nothing(mesh, data):
    """x.new_*(x.shape): autograd accumulates a gradient either by stealing it or with
    `new_empty_strided(..).copy_(grad)`, depending on reference counts that differ between ranks; so
    these must never communicate (a split x once made new_empty_strided box it, on some ranks only: a hang)."""
    shape = (3, 2)
    sbp = data.draw(sbps_for(mesh, shape, partial=True))

    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(torch.randn(shape), p, sbp)
        with gt.comm_log() as log:
            outs = [x.new_empty_strided(shape, (2, 1)), x.new_empty(shape), x.new_zeros(shape), x.new_ones(shape)]
        return len(log.events), [o.sbp for o in outs], gt.rank() in p.flat_ranks, [_held(o) for o in outs[2:]]
    for events, sbps, inside, ((zeros, _), (ones, _)) in gt.launch(body, world_of(mesh)):
        assert events == 0 and sbps[:3] == [sbp] * 3
        assert sbps[3] == tuple(gt.broadcast if isinstance(s, gt.Partial) else s for s in sbp)
        if inside:
            assert torch.equal(zeros, torch.zeros(shape)) and torch.equal(ones, torch.ones(shape))
