"""mm/bmm/addmm/baddbmm and matmul/linear (which autograd lowers to them) against one device."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import MESHES, check, chosen_is_cheapest, meshes, sbps_for

aten = torch.ops.aten
D = torch.float64

OPS = {
    "mm": ((lambda m, k, n, b: [(m, k), (k, n)]), lambda a, b: a @ b),
    "bmm": ((lambda m, k, n, b: [(b, m, k), (b, k, n)]), torch.bmm),
    "addmm": ((lambda m, k, n, b: [(n,), (m, k), (k, n)]), lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2)),
    "baddbmm": ((lambda m, k, n, b: [(b, m, n), (b, m, k), (b, k, n)]), lambda c, a, b: torch.baddbmm(c, a, b)),
    "matmul3d": ((lambda m, k, n, b: [(b, m, k), (k, n)]), torch.matmul),
    "linear": ((lambda m, k, n, b: [(b, m, k), (n, k), (n,)]), F.linear),
}


@st.composite
def cases(draw):
    mesh = draw(meshes())
    name = draw(st.sampled_from(sorted(OPS)))
    dims = [draw(st.integers(1, 5)) for _ in range(4)]
    shapes = OPS[name][0](*dims)
    sbps = [draw(sbps_for(mesh, s, partial=True)) for s in shapes]
    return mesh, name, shapes, sbps


@given(cases())
def test_matrix_ops_match_one_device(case):
    mesh, name, shapes, sbps = case
    torch.manual_seed(1)
    check(OPS[name][1], [torch.randn(s, dtype=D) for s in shapes], mesh, sbps)


@given(st.sampled_from(MESHES), st.data())
def test_mm_choice_is_cheapest_and_uses_the_table(mesh, data):
    a, b = torch.randn(6, 5, dtype=D), torch.randn(5, 7, dtype=D)
    sa, sb = data.draw(sbps_for(mesh, (6, 5), True)), data.draw(sbps_for(mesh, (5, 7), True))
    chosen, best, n = chosen_is_cheapest(aten.mm.default, lambda p: (gt.to_global(a, p, sa), gt.to_global(b, p, sb)),
                                         mesh)
    assert chosen == best


def test_row_times_col_needs_no_boxing():
    def body():
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        x = gt.to_global(torch.randn(4, 6), p, (gt.split(0), gt.split(1)))
        w = gt.to_global(torch.randn(6, 8), p, (gt.broadcast, gt.split(0)))
        with gt.comm_log() as log:
            y = x @ w
        return y.sbp, log.recv_bytes
    sbp, received = gt.launch(body, 4)[0]
    assert sbp == (gt.split(0), gt.partial_sum) and received == 0


@st.composite
def grouped_cases(draw):
    """torch's CPU grouped GEMM takes float32 with 16-byte strides: k and n multiples of 4 (shards need not be)."""
    mesh = draw(meshes())
    g, m, k, n = draw(st.integers(1, 4)), draw(st.integers(1, 9)), draw(st.sampled_from([4, 8])), draw(
        st.sampled_from([4, 8]))
    batched = draw(st.booleans())
    shapes = [(g, m, k), (g, k, n)] if batched else [(m, k), (g, k, n), (g,)]
    sbps = [draw(sbps_for(mesh, s, partial=i < 2)) for i, s in enumerate(shapes)]
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=g - 1, max_size=g - 1)))
    return mesh, shapes, sbps, torch.tensor(cuts + [m], dtype=torch.int32)


@given(grouped_cases())
def test_grouped_mm_matches_one_device(case):
    mesh, shapes, sbps, offs = case
    torch.manual_seed(2)
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    if len(shapes) == 2:
        check(lambda a, b: torch._grouped_mm(a, b), [a, b], mesh, sbps, rtol=1e-4, atol=1e-5)
    else:
        check(lambda a, b, o: torch._grouped_mm(a, b, offs=o), [a, b, offs], mesh, sbps, rtol=1e-4, atol=1e-5)


def test_expert_split_grouped_mm_moves_nothing():
    """Experts S(0), tokens whole: each rank computes its experts' rows (P); the weight gradient stays S(0)."""
    offs = torch.tensor([3, 3, 7, 8], dtype=torch.int32)

    def body():
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.randn(8, 4), p, gt.broadcast).requires_grad_()
        w = gt.to_global(torch.randn(4, 4, 8), p, gt.split(0)).requires_grad_()
        o = gt.to_global(offs, p, gt.broadcast)
        with gt.comm_log() as log:
            y = torch._grouped_mm(x, w, offs=o)
            y.backward(gt.to_global(torch.ones(8, 8), p, gt.broadcast))
        return y.sbp, w.grad.sbp, x.grad.sbp, log.recv_bytes
    assert gt.launch(body, 2)[0] == ((gt.partial_sum,), (gt.split(0),), (gt.partial_sum,), 0)
