"""linalg_vector_norm and _foreach_norm: split kept dims pass; a split reduced dim is a partial sum (or
max/min) and one reduction, never a gather; values and gradients match one device."""
from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import check, mesh_placement, meshes, sbps_for

D = torch.float64
ORDERS = [2.0, 1.0, 3.0, 0.5, math.inf, -math.inf, 0.0]


@given(meshes(), st.lists(st.integers(2, 5), min_size=1, max_size=3), st.sampled_from(ORDERS), st.booleans(),
       st.data())
def test_vector_norm_matches_one_device(mesh, shape, order, keep, data):
    dims = data.draw(st.one_of(st.none(), st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=2,
                                                   unique=True)))
    sbp = data.draw(sbps_for(mesh, tuple(shape)))
    torch.manual_seed(3)
    x = torch.randn(shape, dtype=D) + 0.1  # no exact zeros: the 0-"norm" and the gradients stay defined
    grad = order not in (0.0,)
    check(lambda t: torch.linalg.vector_norm(t, order, dim=dims, keepdim=keep), [x], mesh, [sbp], grad=grad)


def test_norm_of_a_split_tensor_moves_one_scalar_and_foreach_norm_one_bucket():
    def body():
        p = mesh_placement((2,))
        xs = [gt.to_global(torch.randn(6, 3, dtype=D), p, gt.split(0)) for _ in range(3)]
        with gt.comm_log() as one:
            n = torch.linalg.vector_norm(xs[0])
            v = n.full_tensor()
        with gt.comm_log() as many:
            norms = torch._foreach_norm(xs, 2)
            vs = [t.full_tensor() for t in norms]
        want = [torch.linalg.vector_norm(x.full_tensor()) for x in xs]
        return v, vs, want, [(e.kind, e.recv_bytes) for e in one.events], [(e.kind, e.recv_bytes) for e in many.events]
    v, vs, want, one, many = gt.launch(body, 2)[0]
    torch.testing.assert_close(v, want[0])
    for a, b in zip(vs, want):
        torch.testing.assert_close(a, b)
    assert one == [("all_reduce", 8)]                 # the partial sum of squares, one fp64 scalar
    assert many == [("all_reduce", 24)]               # three partial sums, one bucket
