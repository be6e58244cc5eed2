"""The same round-trips under real gloo processes, and failures that end instead of hanging."""
import time

import numpy as np
import pytest
import torch

import globaltensor as gt
from strategies import expected_shard
from test_core_tensor import oracle

CASES = [  # (mesh ranks, global shape, sbp)
    ([0, 1, 2, 3], (7, 3), (gt.split(0),)),
    ([0, 1, 2, 3], (3, 2), (gt.split(0),)),  # fewer rows than ranks
    ([[0, 1], [2, 3]], (5, 7), (gt.split(0), gt.split(1))),
    ([[0, 1], [2, 3]], (5, 3), (gt.split(1), gt.split(1))),
    ([[3, 1], [0, 2]], (6, 5), (gt.broadcast, gt.split(1))),
    ([2, 0], (5,), (gt.split(0),)),  # a subset of the world, not in rank order
    ([[1], [3]], (4, 1), (gt.split(0), gt.broadcast)),
]
PARTIAL_CASES = [
    ([[0, 1], [2, 3]], (5, 2), (gt.partial("max"), gt.split(0))),
    ([[0, 1], [2, 3]], (3,), (gt.partial_sum, gt.partial("min"))),
    ([1, 2, 3], (2, 3), (gt.partial_sum,)),
]


def _round_trips():
    out = []
    for ranks, shape, sbp in CASES:
        p = gt.placement("cpu", ranks)
        full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        x = gt.to_global(torch.from_numpy(full), p, sbp)
        local = x.to_local()
        y = gt.from_local(local, p, sbp)
        if gt.rank() in p:
            np.testing.assert_array_equal(local.numpy(), expected_shard(full, p, sbp, gt.rank()))
            assert torch.equal(x.full_tensor(), torch.from_numpy(full))
            assert torch.equal(y.full_tensor(), torch.from_numpy(full))
        else:
            assert local.numel() == 0
        out.append(tuple(y.shape))
    for ranks, shape, sbp in PARTIAL_CASES:
        p = gt.placement("cpu", ranks)
        c = p.coord(gt.rank())
        local = torch.arange(float(np.prod(shape))).reshape(shape) * (gt.rank() + 1) - 4
        local = local[tuple(slice(a, a + n) for a, n in gt.Layout(p, sbp).shard(shape, gt.rank()))] if c else local
        x = gt.from_local(local if c is not None else torch.empty(0), p, sbp, shape=shape)
        out.append(x.full_tensor().tolist() if c is not None else None)
    return out


@pytest.mark.gloo
def test_round_trips_under_gloo_processes_match_the_simulator():
    t0 = time.monotonic()
    real = gt.launch(_round_trips, 4, backend="gloo", timeout=60)
    sim = gt.launch(_round_trips, 4, backend="sim")
    assert real == sim
    for r in range(4):
        assert real[r][:len(CASES)] == [shape for _, shape, _ in CASES]
    # the partial cases against an independent oracle
    for k, (ranks, shape, sbp) in enumerate(PARTIAL_CASES):
        p = gt.placement("cpu", ranks)
        by_coord = {}
        for r in p.flat_ranks:
            local = (torch.arange(float(np.prod(shape))).reshape(shape) * (r + 1) - 4).numpy()
            by_coord[p.coord(r)] = expected_shard(local, p, sbp, r)
        want = oracle(by_coord, p, sbp).tolist()
        for r in p.flat_ranks:
            assert real[r][len(CASES) + k] == want
    assert time.monotonic() - t0 < 120


def _fails_on_rank_1():
    if gt.rank() == 1:
        raise ValueError("rank one is broken")
    gt.from_local(torch.ones(2), gt.placement("cpu", [0, 1, 2]), gt.split(0))  # waits for rank 1


def _mismatch():
    from globaltensor.runtime import context
    c = context.current()
    if gt.rank() == 0:
        c.all_reduce(torch.ones(1), (0, 1))
    # rank 1 skips the collective and then waits in another one
    c.barrier()


@pytest.mark.gloo
def test_a_failing_gloo_rank_raises_in_the_caller_without_hanging():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank one") as info:
        gt.launch(_fails_on_rank_1, 3, backend="gloo", timeout=60)
    assert info.value.rank == 1 and "_fails_on_rank_1" in "".join(info.value.__notes__)
    assert time.monotonic() - t0 < 40  # well inside the 60 s collective timeout


@pytest.mark.gloo
def test_a_gloo_collective_that_never_completes_times_out_naming_it():
    t0 = time.monotonic()
    with pytest.raises(gt.CollectiveError, match="all_reduce|all_gather_object"):
        gt.launch(_mismatch, 2, backend="gloo", timeout=3)
    assert time.monotonic() - t0 < 60
