"""Point-to-point as a pipeline uses it: a send does not wait for its receiver, and messages are
matched by what they are (their tag), never by the order they arrive in.

A pipeline's stages run different schedules: a stage sends micro-batch 0's activation and goes on
to its next action before the next stage has posted the receive (else at most one micro-batch is in
flight, and 1F1B's steady state cannot form); a stage may receive a gradient before an activation
that was sent earlier. Both are checked here on the simulator and on two gloo processes, with a
barrier that no rank can pass unless the sends returned first: a send that waited for its receiver
would never complete, and the launch's timeout would end the test with an error, not a hang.
"""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from globaltensor.runtime import context


def _sends_return_first_and_match_by_tag() -> object:
    comm = context.current()
    old = comm.p2p_tag, comm.p2p_async
    comm.p2p_async = True
    try:
        if comm.rank == 0:
            comm.p2p_tag = 1
            comm.exchange({1: torch.full((3,), 1.0)}, {})
            comm.p2p_tag = 2
            comm.exchange({1: torch.arange(5.0)}, {})
            comm.barrier()  # rank 1 posts its receives only after this: the sends above did not wait for them
            comm.flush_sends()
            return None
        comm.barrier()
        comm.p2p_tag = 2  # the later message first
        late = comm.exchange({}, {0: ((5,), torch.float32)})[0]
        comm.p2p_tag = 1
        early = comm.exchange({}, {0: ((3,), torch.float32)})[0]
        return early.tolist(), late.tolist()
    finally:
        comm.p2p_tag, comm.p2p_async = old


@pytest.mark.parametrize("backend", ["sim", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_sends_do_not_wait_for_the_receiver_and_match_by_tag(backend):
    got = gt.launch(_sends_return_first_and_match_by_tag, world_size=2, backend=backend, timeout=60)
    assert got[1] == ([1.0, 1.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0])


def _posted_ahead(mismatch: bool) -> object:
    """Rank 1 posts two receives under one tag and key before rank 0 sends anything, then asks for them (the
    second into a buffer of its own) and for a third it did not post; with `mismatch`, it asks for another
    shape than it posted."""
    comm = context.current()
    old = comm.p2p_tag, comm.p2p_async
    comm.p2p_async, comm.p2p_tag = True, 5
    try:
        if comm.rank == 0:
            comm.barrier()
            for k, n in enumerate([3, 3, 2]):
                comm.exchange({1: torch.full((n,), float(k))}, {}, key=7)
            comm.flush_sends()
            return None
        comm.post_receive(0, (3,), torch.float32, key=7)
        comm.post_receive(0, (3,), torch.float32, key=7)
        comm.barrier()  # posted before any send: matched in posting order, as the sends come
        if mismatch:
            comm.exchange({}, {0: ((4,), torch.float32)}, key=7)
        first = comm.exchange({}, {0: ((3,), torch.float32)}, key=7)[0]
        mine = torch.empty(3)
        second = comm.exchange({}, {0: ((3,), torch.float32)}, into={0: mine}, key=7)[0]
        third = comm.exchange({}, {0: ((2,), torch.float32)}, key=7)[0]
        return first.tolist(), second is mine, second.tolist(), third.tolist(), comm.posted_left()
    finally:
        comm.p2p_tag, comm.p2p_async = old


@pytest.mark.parametrize("backend", ["sim", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_receives_posted_ahead_are_matched_in_order_and_into_the_callers_buffer(backend):
    got = gt.launch(_posted_ahead, world_size=2, backend=backend, args=(False,), timeout=60)[1]
    assert got == ([0.0] * 3, True, [1.0] * 3, [2.0] * 2, [])


def test_a_receive_asked_for_in_another_shape_than_posted_is_an_error():
    with pytest.raises(RuntimeError, match=r"posted ahead \(tag \d+\) holds \(3,\) torch.float32, but the "
                                           r"program now receives \(4,\)"):
        gt.launch(_posted_ahead, world_size=2, args=(True,), timeout=20)
