"""Issue 17 item 5: a collective mismatch under gloo fails within seconds naming both calls (it waited
out the 300 s timeout with "Timed out waiting ... for send operation")."""
import time

import pytest
import torch

import globaltensor as gt
from globaltensor.runtime import context
from globaltensor.runtime.watch import sizes


def _started(path):
    """Note when this rank reached the program (process start-up is not part of the wait measured)."""
    with open(f"{path}.{gt.rank()}", "w") as f:
        f.write(repr(time.time()))


def _different_collectives(path):
    _started(path)
    c = context.current()
    if gt.rank() == 0:
        c.all_reduce(torch.ones(4), (0, 1))
    else:
        c.all_gather(torch.ones(4), (0, 1))


def _one_rank_skips(path):
    _started(path)
    x = gt.to_global(torch.arange(8.0), gt.placement("cpu", [0, 1]), gt.split(0))
    if gt.rank() == 0:  # rank 1 skips the gather and returns
        x.full_tensor()
    return gt.rank()


def _skips_then_waits_elsewhere(path):
    _started(path)
    c = context.current()
    if gt.rank() == 0:
        c.all_reduce(torch.ones(3), (0, 1))
    c.barrier()


def _slow_but_matched(path):
    _started(path)
    c = context.current()
    if gt.rank() == 1:
        time.sleep(3)  # rank 0 waits 3 s in the all_reduce: slow, not a mismatch
    return c.all_reduce(torch.ones(2) * (gt.rank() + 1), (0, 1)).tolist()


def _launch_timed(fn, tmp_path):
    """(result or exception, seconds from the ranks' start of the program to the caller's error)."""
    path = str(tmp_path / "started")
    try:
        out = gt.launch(fn, 2, backend="gloo", timeout=120, args=(path,))
    except Exception as e:  # noqa: BLE001
        out = e
    end = time.time()
    starts = [float(open(f"{path}.{r}").read()) for r in range(2)]
    return out, end - min(starts)


@pytest.mark.gloo
def test_two_ranks_in_different_collectives_fail_naming_both(tmp_path):
    err, took = _launch_timed(_different_collectives, tmp_path)
    assert isinstance(err, gt.CollectiveError), err
    text = str(err)
    assert "all_reduce #1 on group (0, 1) [4 x float32, sum]" in text, text
    assert "all_gather #1 on group (0, 1) [4 x float32 per rank]" in text, text
    assert took < 10, took


@pytest.mark.gloo
def test_a_rank_that_skips_a_collective_is_named(tmp_path):
    err, took = _launch_timed(_one_rank_skips, tmp_path)
    assert isinstance(err, gt.CollectiveError), err
    text = str(err)
    assert "rank 0" in text and "all_gather #" in text and "rank 1 returned from the program (collectives made: none)" in text, text
    assert took < 10, took


@pytest.mark.gloo
def test_a_rank_that_skips_and_waits_in_the_next_collective_is_named(tmp_path):
    err, took = _launch_timed(_skips_then_waits_elsewhere, tmp_path)
    assert isinstance(err, gt.CollectiveError), err
    text = str(err)
    assert "all_reduce #1 on group (0, 1) [3 x float32, sum]" in text and "all_gather_object #1" in text, text
    assert took < 10, took


@pytest.mark.gloo
def test_a_slow_rank_is_not_a_mismatch(tmp_path):
    got, took = _launch_timed(_slow_but_matched, tmp_path)
    assert got == [[3.0, 3.0], [3.0, 3.0]], got


def test_sizes_read_as_a_user_reads_them():
    assert sizes("all_reduce", (4, torch.float32, "sum")) == "4 x float32, sum"
    assert sizes("broadcast", ((2, 3), torch.int64, 1)) == "(2, 3) int64 from rank 1"
    assert sizes("all_gather_object", "objects") == "objects"


def test_what_a_rank_is_doing_is_read_from_its_stack():
    """A hang report says what the stuck rank is doing (`watch.doing_now`): the innermost module forward and the
    program's own line (not globaltensor's or torch's), read from the thread's stack only when reported."""
    import threading
    import torch
    from globaltensor.runtime.watch import doing_now

    class Stuck(torch.nn.Module):
        def forward(self, x):
            return x, doing_now(threading.get_ident())

    _, doing = Stuck()(torch.ones(1))
    assert doing["module"] == "Stuck" and doing["op"] is None
    assert doing["at"].split(" in ")[0].endswith("test_collective_watch.py:" + str(
        Stuck.forward.__code__.co_firstlineno + 1)) and doing["at"].endswith("in forward")
