"""sum/mean/amax/amin/max: split reduced dims give P / P(max) / P(min); values and grads match one device."""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import check, meshes, mesh_placement, sbps_for

D = torch.float64
REDUCE = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k), "mean": lambda x, d, k: x.mean(d, keepdim=k),
    "amax": lambda x, d, k: x.amax(d, keepdim=k), "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "max": lambda x, d, k: x.max(d[0], keepdim=k).values, "sum_all": lambda x, d, k: x.sum(),
    "mean_all": lambda x, d, k: x.mean(), "max_all": lambda x, d, k: x.max(),
}


@given(meshes(), st.lists(st.integers(2, 5), min_size=1, max_size=3), st.sampled_from(sorted(REDUCE)),
       st.booleans(), st.data())
def test_reductions_match_one_device(mesh, shape, name, keep, data):
    dims = sorted(set(data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=2))))
    sbp = data.draw(sbps_for(mesh, tuple(shape), partial=name.startswith(("sum", "mean"))))
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=D)
    check(lambda t: REDUCE[name](t, dims, keep), [x], mesh, [sbp])


def test_split_reduced_dim_gives_partial_without_communication():
    def body():
        p = mesh_placement((2, 2))
        x = gt.to_global(torch.randn(4, 6), p, (gt.split(0), gt.split(1)))
        with gt.comm_log() as log:
            s, m = x.sum(0), x.amax(1)
        return s.sbp, m.sbp, log.recv_bytes
    s, m, received = gt.launch(body, 4)[0]
    assert s == (gt.partial_sum, gt.split(0)) and m == (gt.split(0), gt.partial("max")) and received == 0
