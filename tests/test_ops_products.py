"""Vector and matrix products (ops/products.py) and the reductions of ops/reduction.py (prod, logsumexp, nansum, aminmax, norms) on any layout:
values and gradients equal one device's; a contracted split leaves P (moving nothing until read: then
one all-reduce of the output), and prod/logsumexp over a split dim all-gather only the shards' results."""
from __future__ import annotations

import warnings

import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor.runtime.comm import all_reduce_recv_bytes
from ops_support import Mesh, check, mesh_placement, meshes, sbps_for

MESHES = [(2,), (3,), (4,), (2, 2)]
F64 = torch.float64


def _layouts(data, mesh, shapes, partial=False):
    return [data.draw(sbps_for(mesh, s, partial=partial)) for s in shapes]


PRODUCTS = {
    "dot": (lambda a, b: torch.dot(a, b), [(7,), (7,)]),
    "vdot": (lambda a, b: torch.vdot(a, b), [(6,), (6,)]),
    "mv": (lambda a, v: torch.mv(a, v), [(5, 7), (7,)]),
    "addmv": (lambda c, a, v: torch.addmv(c, a, v, beta=0.5, alpha=2.0), [(5,), (5, 7), (7,)]),
    "addr": (lambda c, u, v: torch.addr(c, u, v, beta=0.5, alpha=2.0), [(5, 6), (5,), (6,)]),
    "addbmm": (lambda c, a, b: torch.addbmm(c, a, b, beta=0.5, alpha=2.0), [(3, 4), (5, 3, 6), (5, 6, 4)]),
    "addmm_": (lambda c, a, b: (c * 1.0).addmm_(a, b, alpha=2.0), [(5, 4), (5, 6), (6, 4)]),
    "baddbmm_": (lambda c, a, b: (c * 1.0).baddbmm_(a, b, beta=0.5), [(3, 5, 4), (3, 5, 6), (3, 6, 4)]),
    "addmv_": (lambda c, a, v: (c * 1.0).addmv_(a, v), [(5,), (5, 7), (7,)]),
    "addr_": (lambda c, u, v: (c * 1.0).addr_(u, v), [(5, 6), (5,), (6,)]),
    "trace": (lambda a: torch.trace(a), [(6, 5)]),
    "bilinear": (lambda x1, x2, w, b: torch.nn.functional.bilinear(x1, x2, w, b), [(6, 3), (6, 4), (5, 3, 4), (5,)]),
    "cdist": (lambda a, b: torch.cdist(a, b), [(2, 5, 3), (2, 6, 3)]),
    "cdist_p1": (lambda a, b: torch.cdist(a, b, p=1.0), [(7, 3), (5, 3)]),
}


@given(meshes(MESHES), st.sampled_from(sorted(PRODUCTS)), st.data())
def test_products_match_one_device(mesh, name, data):
    """Every operand laid out at random (splits of any dim, Broadcast, Partial): one device's values and
    gradients."""
    fn, shapes = PRODUCTS[name]
    torch.manual_seed(1)
    xs = [torch.randn(s, dtype=F64) for s in shapes]
    check(fn, xs, mesh, _layouts(data, mesh, shapes, partial=not name.startswith("cdist")))


REDUCTIONS = {
    "prod": (lambda x: torch.prod(x), (4, 5)),
    "prod_dim": (lambda x: torch.prod(x, 1, keepdim=True), (4, 6)),
    "logsumexp": (lambda x: torch.logsumexp(x, (0, 1)), (5, 4, 3)),
    "logsumexp_dim": (lambda x: torch.logsumexp(x, 1), (4, 7)),
    "nansum": (lambda x: torch.nansum(torch.where(x > 1, float("nan"), x), 0), (6, 3)),
    "aminmax": (lambda x: torch.aminmax(x, dim=0), (5, 4)),
    "aminmax_all": (lambda x: torch.aminmax(x), (5, 4)),
    "norm": (lambda x: torch.norm(x, 3, dim=1), (5, 4)),
    "dist": (lambda x, y: torch.dist(x, y, 1.5), (5, 4)),
    "renorm": (lambda x: torch.renorm(x, 2, 1, 1.5), (5, 4, 3)),
    "renorm_": (lambda x: (x * 1.0).renorm_(1, 0, 2.0), (5, 4)),
    "logcumsumexp": (lambda x: torch.logcumsumexp(x, 0), (7, 3)),
}


@given(meshes(MESHES), st.sampled_from(sorted(REDUCTIONS)), st.data())
def test_reductions_match_one_device(mesh, name, data):
    """Splits of reduced and kept dims at random (an uneven and an empty shard included: 4 or 5 rows on 4
    ranks): one device's values and gradients."""
    fn, shape = REDUCTIONS[name]
    n = 2 if name == "dist" else 1
    torch.manual_seed(2)
    xs = [torch.rand(shape, dtype=F64) + 0.5 for _ in range(n)]
    check(fn, xs, mesh, _layouts(data, mesh, [shape] * n))


def _logged(fn, mesh, inputs, sbps, read=True):
    """Per rank: (output sbp, the op's collectives, the read's collectives, the full output)."""
    def body():
        p = mesh_placement(mesh)
        xs = [gt.to_global(t, p, s) for t, s in zip(inputs, sbps)]
        with gt.comm_log() as op_log:
            y = fn(*xs)
        with gt.comm_log() as read_log:
            full = y.full_tensor()
        return (y.sbp, [(e.kind, e.recv_bytes) for e in op_log.events],
                [(e.kind, e.recv_bytes) for e in read_log.events], full)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gt.launch(body, len(mesh.ranks))


def test_contracted_splits_leave_partial_and_one_all_reduce():
    """dot of two S(0) vectors, mv with the matrix's columns and the vector split, addbmm's batch split,
    trace of a row split: nothing moves for the op, the output is P, and reading it is one all-reduce of
    the output (textbook: reduce-scatter plus all-gather bytes of its numel)."""
    s0, s1 = gt.split(0), gt.split(1)
    torch.manual_seed(4)
    cases = [(torch.dot, [torch.randn(9, dtype=F64), torch.randn(9, dtype=F64)], [(s0,), (s0,)]),
             (torch.mv, [torch.randn(5, 8, dtype=F64), torch.randn(8, dtype=F64)], [(s1,), (s0,)]),
             (lambda c, a, b: torch.addbmm(c, a, b), [torch.randn(3, 4, dtype=F64), torch.randn(8, 3, 2, dtype=F64),
                                                     torch.randn(8, 2, 4, dtype=F64)], [(gt.broadcast,), (s0,), (s0,)]),
             (torch.trace, [torch.randn(8, 6, dtype=F64)], [(s0,)])]
    mesh = Mesh((4,))
    for fn, xs, sbps in cases:
        want = fn(*xs)
        for rank, (sbp, op_ev, read_ev, full) in enumerate(_logged(fn, mesh, xs, sbps)):
            torch.testing.assert_close(full, want)
            assert sbp == (gt.partial_sum,) and op_ev == [], (fn, sbp, op_ev)
            assert read_ev == [("all_reduce", all_reduce_recv_bytes(want.numel(), 8, 4, rank))], (fn, read_ev)


def test_prod_and_logsumexp_gather_only_the_results():
    """prod / logsumexp over a long split dim: each rank reduces its rows, and the only traffic is one
    all-gather of the other ranks' results ((n - 1) x the output's bytes); the output is Broadcast."""
    torch.manual_seed(6)
    x = torch.rand(40, 3, dtype=F64) + 0.5
    for fn in (lambda t: torch.prod(t, 0), lambda t: torch.logsumexp(t, 0)):
        for sbp, op_ev, read_ev, full in _logged(fn, Mesh((4,)), [x], [(gt.split(0),)]):
            torch.testing.assert_close(full, fn(x))
            assert sbp == (gt.broadcast,) and op_ev == [("all_gather", 3 * 3 * 8)] and read_ev == []


def test_logcumsumexp_is_a_scan():
    """logcumsumexp along a long split dim: the distributed scan (`ops/reduction.py`), its combine
    logaddexp; the split kept, one all-gather of the other ranks' last rows (3 x 3 float64 here)."""
    torch.manual_seed(6)
    x = torch.randn(40, 3, dtype=F64)
    for rank, (sbp, op_ev, read_ev, full) in enumerate(_logged(lambda t: torch.logcumsumexp(t, 0), Mesh((4,)), [x],
                                                              [(gt.split(0),)])):
        torch.testing.assert_close(full, torch.logcumsumexp(x, 0))
        assert sbp == (gt.split(0),) and op_ev == [("all_gather", 3 * 3 * 8)], (sbp, op_ev)


def test_random_ops_draw_one_devices_values():
    """bernoulli(p), normal(mean, std), normal(mean, float), multinomial (with and without replacement) on
    split parameters: exactly one device's values with the same seed, and nothing gathered."""
    torch.manual_seed(0)
    p0, m0, s0 = torch.rand(7, 6), torch.randn(7, 6), torch.rand(7, 6) + 0.1

    def draws(g):
        return [torch.bernoulli(g(p0)), torch.normal(g(m0), g(s0)), torch.normal(g(m0), 2.0),
                torch.multinomial(g(s0), 3), torch.multinomial(g(s0), 9, replacement=True)]
    torch.manual_seed(3)
    want = draws(lambda t: t)
    for mesh, sbp in [((4,), (gt.split(0),)), ((2, 2), (gt.split(0), gt.split(1))), ((3,), (gt.split(1),))]:
        def body():
            p = mesh_placement(Mesh(mesh))
            gt.reset_stats()
            torch.manual_seed(3)
            return [o.full_tensor() for o in draws(lambda t: gt.to_global(t, p, sbp))], gt.stats()["fallback"]
        for got, fallbacks in gt.launch(body, 4 if mesh != (3,) else 3):
            assert not fallbacks
            for g, w in zip(got, want):
                assert torch.equal(g, w), (mesh, sbp)


def test_rrelu_draws_and_gradients_match_one_device():
    """rrelu in training draws only for negative inputs, so it runs on the whole input, and the noise it
    draws reaches the caller's buffer (the backward's): one device's values and gradients on a split
    input, in place too, on a mesh of 3 ranks (out of order) in a world of 4; eval mode is leaky_relu."""
    torch.manual_seed(0)
    x = torch.randn(12, dtype=F64)
    mesh = Mesh((3,), ranks=(2, 0, 1), world=4)
    for training in (True, False):
        for rrelu in (torch.nn.functional.rrelu, torch.nn.functional.rrelu_):
            torch.manual_seed(5)
            xl = x.clone().requires_grad_()
            want = rrelu(xl * 1.0, 0.1, 0.9, training=training)
            want.sum().backward()

            def body():
                p = mesh_placement(mesh)
                gt.reset_stats()
                gx = gt.to_global(x, p, gt.split(0)).requires_grad_()
                torch.manual_seed(5)
                y = rrelu(gx * 1.0, 0.1, 0.9, training=training)
                y.sum().backward()
                return y.full_tensor(), gx.grad.full_tensor(), gt.stats()["fallback"], gt.rank() in p.flat_ranks
            for y, g, fallbacks, inside in gt.launch(body, mesh.world):
                assert not fallbacks
                if inside:
                    torch.testing.assert_close(y, want.detach())
                    torch.testing.assert_close(g, xl.grad)
