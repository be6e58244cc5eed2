"""Named conversions with exact byte counts, cross-placement moves, route caching, and bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import globaltensor as gt
from globaltensor import boxing
from boxing_support import make, random_locals, value

S0, S1, B, P = gt.split(0), gt.split(1), gt.broadcast, gt.partial_sum
SQUARE = gt.placement("cpu", [[0, 1], [2, 3]])
F32 = torch.float32  # (4, 4) float32: |T| = 64 bytes, a quarter 16, a half 32


def _run(ps, ss, pd, ds, shape, world, seed=0):
    """Convert on the simulator; returns the route and per rank (events, counted bytes)."""
    def body():
        x, _ = make(ps, ss, shape, seed, dtype=F32)
        with gt.comm_log() as log:
            y = x.to_global(pd, ds)
        return [(e.kind, e.group) for e in log.events], log.recv_bytes, (
            y.to_local().numpy().copy() if gt.rank() in pd else None)
    out = gt.launch(body, world)
    before = value(ps, ss, random_locals(ps, ss, shape, seed, F32))
    after = value(pd, ds, {r: out[r][2] for r in pd.flat_ranks})
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)  # float32 sums vs float64
    route = boxing.route(gt.Layout(ps, ss), gt.Layout(pd, ds), shape, F32)
    assert [o[1] for o in out] == [route.recv_bytes_of(r) for r in range(world)]
    return route, [o[0] for o in out]


def test_s0_s1_to_s1_s0_is_one_swap_between_the_off_diagonal_ranks():
    route, events = _run(SQUARE, (S0, S1), SQUARE, (S1, S0), (4, 4), 4)
    assert route.recv_bytes == [0, 16, 16, 0]
    assert [s.primitive for s in route.steps] == ["send_recv"] and route.steps[0].groups == [(1, 2), (1, 2)]
    assert events[0] == events[3] == []  # nothing at all on the diagonal
    assert events[1] == [("send_recv", (1, 2))] and events[2] == [("send_recv", (1, 2))]


def test_s0_s0_to_b_s0_receives_only_the_missing_quarters():
    route, _ = _run(SQUARE, (S0, S0), SQUARE, (B, S0), (4, 4), 4)
    # rank (i, j) holds quarter 2i+j and needs half j: ranks 0 and 3 miss one quarter, 1 and 2 two
    assert route.recv_bytes == [16, 32, 32, 16] == list(route.lower_bound)


def test_p_s1_to_s0_s1_is_one_reduce_scatter_on_axis_0():
    route, events = _run(SQUARE, (P, S1), SQUARE, (S0, S1), (4, 4), 4)
    assert [(s.primitive, s.axis) for s in route.steps] == [("reduce_scatter", 0)]
    assert route.recv_bytes == [16, 16, 16, 16]  # (n-1)/n of each rank's 32-byte column half
    assert events[0] == [("reduce_scatter", (0, 2))]


def test_s0_b_to_b_s0_is_a_swap_of_halves():
    route, events = _run(SQUARE, (S0, B), SQUARE, (B, S0), (4, 4), 4)
    assert route.recv_bytes == [0, 32, 32, 0] == list(route.lower_bound)
    assert events[0] == events[3] == []


def test_uneven_all_to_all_is_a_real_all_to_all():
    line = gt.placement("cpu", [0, 1, 2])
    route, events = _run(line, (S0,), line, (S1,), (5, 4), 3)
    assert [s.primitive for s in route.steps] == ["all_to_all"]
    assert all(ev == [("all_to_all", (0, 1, 2))] for ev in events)
    # rank 0 keeps rows 0-1 x cols 0-1 and receives rows 2-4 x cols 0-1: 6 floats
    assert route.recv_bytes == [24, 12, 16] == list(route.lower_bound)  # rank 2: col 3, rows 0-3


def test_partial_reductions_cost_no_more_than_reduce_scatter_or_all_reduce():
    line = gt.placement("cpu", [0, 1, 2, 3])
    for op in ("sum", "max", "min"):
        route, _ = _run(line, (gt.partial(op),), line, (B,), (4, 4), 4)
        assert [s.primitive for s in route.steps] == ["all_reduce"] and route.recv_bytes == [96] * 4
        route, _ = _run(line, (gt.partial(op),), line, (S0,), (4, 4), 4)
        assert [s.primitive for s in route.steps] == ["reduce_scatter"] and route.recv_bytes == [48] * 4
    # mixed ops reduce the last axis first; (P, P) -> (B, B) beats two all-reduces (128 bytes per rank)
    route, _ = _run(SQUARE, (gt.partial("max"), gt.partial("min")), SQUARE, (S1, B), (4, 4), 4)
    assert route.steps[0].axis == 1
    route, _ = _run(SQUARE, (P, P), SQUARE, (B, B), (4, 4), 4)
    assert max(route.recv_bytes) < 128


def test_cross_placement_disjoint_line_to_wider_line():
    src, dst = gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3, 4])
    route, events = _run(src, (S0,), dst, (S1,), (5, 7), 5)
    # rank 2 needs 5x3, ranks 3 and 4 need 5x2 each; the sources receive nothing
    assert route.recv_bytes == [0, 0, 60, 40, 40]
    assert all(kind == "send_recv" for ev in events for kind, _ in ev)


def test_cross_placement_square_to_line_sends_each_rank_only_its_slice():
    dst = gt.placement("cpu", [4, 5])
    route, _ = _run(SQUARE, (S0, S1), dst, (S0,), (4, 4), 6)
    assert route.recv_bytes == [0, 0, 0, 0, 32, 32]
    ex4 = route.steps[-1].exchange(4)
    assert sorted(p for p, _ in ex4.recvs) == [0, 1]  # the top half comes from the top row only


def test_cross_placement_overlapping_keeps_what_is_held():
    src, dst = gt.placement("cpu", [0, 1, 2]), gt.placement("cpu", [[2, 1], [0, 3]])
    route, _ = _run(src, (S0,), dst, (S0, B), (6, 2), 4)
    # rank 2 needs rows 0-2, holds 4-5: 3 rows; rank 1 needs 0-2 holds 2-3: 2 rows; rank 0 needs 3-5: 3 rows
    assert route.recv_bytes == [24, 16, 24, 24] == list(route.lower_bound)


def test_cross_placement_spreads_sending_over_replicas():
    src, dst = gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [4, 5, 6, 7])
    route, _ = _run(src, (B, B), dst, (S0,), (8, 2), 8)
    step = route.steps[-1]
    senders = [p for r in dst.flat_ranks for p, _ in step.exchange(r).recvs]
    assert sorted(senders) == [0, 1, 2, 3]  # four replicas, four receivers: one piece each
    assert route.recv_bytes[4:] == [16] * 4


def test_partial_target_across_placements_receives_only_on_coordinate_zero():
    src, dst = gt.placement("cpu", [0]), gt.placement("cpu", [[1, 2], [3, 4]])
    route, _ = _run(src, (B,), dst, (P, S1), (3, 4), 5)
    # ranks (0, j) receive their column half; ranks (1, j) hold zeros and receive nothing
    assert route.recv_bytes == [0, 24, 24, 0, 0]


def test_partial_moves_as_it_is_to_another_placement_of_its_mesh_shape():
    """A Partial kept Partial across placements: each rank's whole shard to the rank at its coordinate,
    one message, no reduction (reducing first costs a collective more and the same bytes or more)."""
    src, dst = gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [[4, 5], [6, 7]])
    route, events = _run(src, (P, S1), dst, (P, S1), (4, 4), 8)
    assert [s.primitive for s in route.steps] == ["send_recv"]
    assert route.recv_bytes == [0, 0, 0, 0, 32, 32, 32, 32]
    route, _ = _run(gt.placement("cpu", [0, 1]), (P,), gt.placement("cpu", [2, 3]), (P,), (4, 4), 4)
    assert [s.primitive for s in route.steps] == ["send_recv"] and route.recv_bytes == [0, 0, 64, 64]
    # where the target overlaps the source, reducing first can be cheaper, and is chosen: rank 1 keeps
    # its reduced half, rank 0 sends the other (96 B in all, not 128)
    route, _ = _run(gt.placement("cpu", [0, 1]), (P,), gt.placement("cpu", [1, 2]), (P,), (4, 4), 3)
    assert sum(route.recv_bytes) == 96


def test_b_to_s_is_a_free_view():
    line = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(torch.arange(8.0).reshape(4, 2), line, B)
        with gt.comm_log() as log:
            y = x.to_global(line, S0)
        return log.events, y.to_local().untyped_storage().data_ptr() == x.to_local().untyped_storage().data_ptr()
    assert all(ev == [] and same for ev, same in gt.launch(body, 2))


def test_routes_are_cached_and_explain_themselves():
    a, b = gt.Layout(SQUARE, (S0, S1)), gt.Layout(SQUARE, (S1, S0))
    p1 = boxing.route(a, b, (4, 4), F32)
    assert boxing.route(a, b, [4, 4], F32) is p1
    text = p1.explain()
    assert "send_recv" in text and "[0, 16, 16, 0]" in text and "lower bound" in text and "met" in text
    assert boxing.route(a, a, (4, 4), F32).steps == ()


# -- bad input -------------------------------------------------------------------------------

def test_partial_max_to_partial_sum_is_refused():
    line = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(torch.ones(4), line, gt.partial("max"))
        x.to_global(line, P)
    with pytest.raises(ValueError, match=r"to_global\(sbp\).*P\(max\).*P"):
        gt.launch(body, 2)
    with pytest.raises(ValueError, match="broadcast"):
        boxing.route(gt.Layout(line, gt.partial("max")), gt.Layout(line, P), (4,), F32)


def test_other_device_type_is_refused():
    def body():
        x = gt.to_global(torch.ones(4), gt.placement("cpu", [0, 1]), S0)
        x.to_global(gt.placement("cuda", [0, 1]), S0)
    with pytest.raises(ValueError, match=r"to_global\(placement\).*'cpu'"):
        gt.launch(body, 2)


def test_target_mesh_larger_than_the_world_is_refused():
    big = gt.placement("cpu", [[0, 1], [2, 3]])  # built outside any launch: not checked against a world

    def body():
        x = gt.to_global(torch.ones(4, 4), gt.placement("cpu", [0, 1]), S0)
        x.to_global(big, (S0, S1))
    with pytest.raises(ValueError, match=r"to_global\(placement\).*ranks \[2, 3\].*world of size 2"):
        gt.launch(body, 2)


def test_split_dim_out_of_range_is_refused():
    with pytest.raises(ValueError, match="sbp"):
        boxing.route(gt.Layout(SQUARE, (S0, S1)), gt.Layout(SQUARE, (gt.split(2), B)), (4, 4), F32)


def test_one_holder_many_receivers_is_a_broadcast():
    src, dst = gt.placement("cpu", [0]), gt.placement("cpu", [[1, 2], [3, 4]])
    route, events = _run(src, (B,), dst, (B, B), (3, 4), 5)
    assert [s.primitive for s in route.steps] == ["broadcast"] and route.recv_bytes == [0, 48, 48, 48, 48]
    assert all(ev == [("broadcast", (0, 1, 2, 3, 4))] for ev in events)
    # two replicas share the work: two broadcasts of two receivers each
    route, events = _run(gt.placement("cpu", [0, 1]), (B,), gt.placement("cpu", [2, 3, 4, 5]), (B,), (3, 4), 6)
    assert sorted({g for ev in events for _, g in ev}) == [(0, 2, 4), (1, 3, 5)]
    assert route.recv_bytes == [0, 0, 48, 48, 48, 48]
