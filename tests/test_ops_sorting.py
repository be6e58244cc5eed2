"""Ops that work along one dim (topk, sort, kthvalue, median, cummax, cumsum, flip) and histc against one
device: values, indices and gradients for any input nd-SBP, uneven shapes, worlds larger than the mesh;
a split of a dim they do not work along moves nothing."""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import check, mesh_placement, meshes, sbps_for

D = torch.float64

ALONG = {
    "topk": lambda x, d: x.topk(min(2, x.shape[d]), dim=d),
    "topk_smallest": lambda x, d: x.topk(1, dim=d, largest=False),
    "sort": lambda x, d: x.sort(dim=d, descending=True),
    "sort_stable": lambda x, d: torch.sort(x, dim=d, stable=True),
    "argsort_gather": lambda x, d: x.gather(d, x.argsort(dim=d)),
    "kthvalue": lambda x, d: x.kthvalue(1, dim=d, keepdim=True),
    "median": lambda x, d: x.median(dim=d),
    "cummax": lambda x, d: x.cummax(dim=d),
    "cumsum": lambda x, d: x.cumsum(d) * 2,
    "flip": lambda x, d: x.flip(d) - x.flip(0),
}


@given(meshes(), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.sampled_from(sorted(ALONG)), st.data())
def test_along_dim_ops_match_one_device(mesh, shape, name, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    sbp = data.draw(sbps_for(mesh, tuple(shape), partial=name in ("cumsum", "flip")))
    torch.manual_seed(11)
    x = torch.randn(shape, dtype=D)
    check(lambda t: ALONG[name](t, dim), [x], mesh, [sbp])


@given(meshes(), st.lists(st.integers(0, 5), min_size=1, max_size=3), st.sampled_from([(4, -1.0, 1.0), (3, 0.0, 0.0)]),
       st.data())
def test_histc_matches_one_device(mesh, shape, bins_range, data):
    bins, lo, hi = bins_range
    sbp = data.draw(sbps_for(mesh, tuple(shape)))
    torch.manual_seed(12)
    x = torch.randn(shape, dtype=D)
    check(lambda t: torch.histc(t, bins, lo, hi), [x], mesh, [sbp], grad=False)


def test_split_off_the_dim_moves_nothing_and_histc_counts_shards():
    def body():
        p = mesh_placement((2, 2))
        x = gt.to_global(torch.randn(6, 5, 4), p, (gt.split(0), gt.split(2)))
        with gt.comm_log() as log:
            v, i = x.topk(2, dim=1)
            s, j = x.sort(dim=1)
            c = x.cumsum(1)
            h = torch.histc(x, 5, -2.0, 2.0)
        return [t.sbp for t in (v, i, s, j, c, h)], log.recv_bytes
    sbps, received = gt.launch(body, 4)[0]
    split = (gt.split(0), gt.split(2))
    assert sbps == [split] * 5 + [(gt.partial_sum, gt.partial_sum)] and received == 0


def test_backward_with_a_split_off_the_dim_moves_nothing():
    """The backward (new_zeros + scatter along dim, flip + cumsum) keeps the split too."""
    fns = {"topk": lambda x: x.topk(2, dim=1).values, "sort": lambda x: x.sort(1).values,
           "median": lambda x: x.median(1).values, "cumsum": lambda x: x.cumsum(1)}

    def body():
        p = mesh_placement((2,))
        out = {}
        for name, f in fns.items():
            x = gt.to_global(torch.randn(6, 5, dtype=D), p, gt.split(0)).requires_grad_()
            with gt.comm_log() as log:
                y = f(x)
                y.backward(torch.ones_like(y))
            out[name] = (log.recv_bytes, x.grad.sbp)
        return out
    assert gt.launch(body, 2)[0] == {name: (0, (gt.split(0),)) for name in fns}
