"""The simulator behaves per rank like torchrun processes, and never hangs."""
import random
import time

import numpy as np
import pytest
import torch

import globaltensor as gt
from globaltensor.runtime import context


def comm():
    return context.current()


def test_launch_returns_results_in_rank_order():
    assert gt.launch(lambda: (gt.rank(), gt.world_size()), 3) == [(0, 3), (1, 3), (2, 3)]
    assert gt.launch(lambda a, b: a + b * gt.rank(), 2, args=(1, 10)) == [1, 11]


def test_each_rank_has_its_own_rng_like_a_process():
    def body():
        torch.manual_seed(0)
        w = torch.nn.Linear(4, 3).weight.detach().clone()
        # ranks draw different amounts, with switches in between: no rank sees another's draws
        draws = [torch.rand(1) for _ in range(gt.rank() + 1)]
        comm().barrier()
        after = torch.rand(2)
        return w, torch.cat(draws), after, np.random.rand(), random.random()

    torch.manual_seed(0)
    w0 = torch.nn.Linear(4, 3).weight.detach()
    outs = gt.launch(body, 3)
    for r, (w, draws, after, _, _) in enumerate(outs):
        assert torch.equal(w, w0)
        torch.manual_seed(0)
        torch.nn.Linear(4, 3)
        ref = torch.rand(r + 1 + 2)
        assert torch.equal(torch.cat([draws, after]), ref)
    assert len({o[3] for o in outs}) == 1 and len({o[4] for o in outs}) == 1


def test_launch_leaves_the_callers_rng_alone():
    torch.manual_seed(3)
    gt.launch(lambda: torch.rand(100), 2)
    a = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(1))


def test_received_tensors_are_not_shared_between_ranks():
    def body():
        c = comm()
        pieces = c.all_gather(torch.full((2,), float(gt.rank())), (0, 1, 2))
        for p in pieces:
            p.add_(100)  # must not leak into any other rank's copy
        c.barrier()
        total = c.all_reduce(torch.ones(2), (0, 1, 2))
        total.mul_(gt.rank() + 1)
        c.barrier()
        return [p.tolist() for p in pieces], total.tolist()

    outs = gt.launch(body, 3)
    for r, (pieces, total) in enumerate(outs):
        assert pieces == [[100.0 + q] * 2 for q in range(3)]
        assert total == [3.0 * (r + 1)] * 2


def test_primitives_and_their_byte_accounting():
    def body():
        c, r = comm(), gt.rank()
        g = (2, 0, 1)  # mesh order need not be rank order
        out = {}
        with gt.comm_log() as log:
            out["ag"] = [t.tolist() for t in c.all_gather(torch.arange(r + 1.0), g, [(3,), (1,), (2,)])]
            chunks = [torch.full((n,), float(r)) for n in (3, 1, 2)]
            out["rs"] = c.reduce_scatter(chunks, g).tolist()
            out["ar_max"] = c.all_reduce(torch.tensor([float(r), -float(r)]), g, "max").tolist()
            sends = [torch.full((r + 1, j + 1), float(10 * r + j)) for j in range(3)]
            recv_shapes = [(q + 1, g.index(r) + 1) for q in g]
            out["a2a"] = [t.tolist() for t in c.all_to_all(sends, g, recv_shapes)]
            out["bc"] = c.broadcast(torch.tensor([7.0, 8.0]) if r == 1 else None, g, 1, (2,), torch.float32).tolist()
            peer = (r + 1) % 3
            out["p2p"] = c.exchange({peer: torch.full((r + 1,), float(r))},
                                    {(r - 1) % 3: ((((r - 1) % 3) + 1,), torch.float32)})[(r - 1) % 3].tolist()
        return out, [(e.kind, e.group, e.recv_bytes) for e in log.events]

    outs = gt.launch(body, 3)
    for r, (out, events) in enumerate(outs):
        i = (2, 0, 1).index(r)
        assert out["ag"] == [[0.0, 1.0, 2.0], [0.0], [0.0, 1.0]]
        assert out["rs"] == [3.0] * (3, 1, 2)[i]
        assert out["ar_max"] == [2.0, 0.0]
        assert out["a2a"] == [[[10.0 * q + i] * (i + 1)] * (q + 1) for q in (2, 0, 1)]
        assert out["bc"] == [7.0, 8.0]
        src = (r - 1) % 3
        assert out["p2p"] == [float(src)] * (src + 1)
        own = (3, 1, 2)[i]
        numel_ar = 2
        ar_chunk = [1, 1, 0][i]
        a2a_recv = sum((q + 1) * (i + 1) for q in (2, 0, 1) if q != r)
        assert events == [
            ("all_gather", (2, 0, 1), 4 * (6 - own)),
            ("reduce_scatter", (2, 0, 1), 4 * 2 * own),
            ("all_reduce", (2, 0, 1), 4 * (2 * ar_chunk + numel_ar - ar_chunk)),
            ("all_to_all", (2, 0, 1), 4 * a2a_recv),
            ("broadcast", (2, 0, 1), 0 if r == 1 else 8),
            ("send_recv", tuple(sorted({r, (r + 1) % 3, (r - 1) % 3})), 4 * (src + 1)),
        ]


def _fails_on_rank_2():
    if gt.rank() == 2:
        raise KeyError("rank two is broken")
    comm().all_reduce(torch.ones(1), (0, 1, 2, 3))


def test_a_failing_rank_surfaces_with_its_rank_and_releases_the_others():
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="rank two") as info:
        gt.launch(_fails_on_rank_2, 4, timeout=30)
    assert info.value.rank == 2
    assert "rank 2" in "".join(info.value.__notes__)
    assert time.monotonic() - t0 < 10


def test_a_collective_mismatch_names_both_collectives():
    def body():
        c = comm()
        if gt.rank() == 0:
            c.all_reduce(torch.ones(1), (0, 1))
        else:
            c.all_gather(torch.ones(1), (0, 1))

    with pytest.raises(gt.CollectiveError, match="all_reduce.*all_gather|all_gather.*all_reduce"):
        gt.launch(body, 2, timeout=30)


def test_a_missing_rank_names_the_collective_at_once():
    def body():
        if gt.rank() != 1:
            comm().all_reduce(torch.ones(1), (0, 1, 2))

    t0 = time.monotonic()
    with pytest.raises(gt.CollectiveError, match=r"all_reduce on group \(0, 1, 2\).*finished without joining"):
        gt.launch(body, 3, timeout=60)
    assert time.monotonic() - t0 < 5  # the scheduler sees the deadlock; no need to wait for the timeout


def test_a_rank_that_never_arrives_times_out():
    def body():
        if gt.rank() == 1:
            time.sleep(1.5)  # busy outside any collective, longer than the timeout
        comm().all_reduce(torch.ones(1), (0, 1))

    t0 = time.monotonic()
    with pytest.raises(gt.CollectiveError, match="timed out after 0.5s.*all_reduce"):
        gt.launch(body, 2, timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_launch_cannot_nest():
    with pytest.raises(RuntimeError, match="nesting"):
        gt.launch(lambda: gt.launch(lambda: 0, 2), 2)


def test_a_plain_process_is_a_world_of_one():
    assert gt.rank() == 0 and gt.world_size() == 1
    x = gt.to_global(torch.arange(4.0), gt.placement("cpu", [0]), gt.split(0))
    assert torch.equal(x.full_tensor(), torch.arange(4.0))
