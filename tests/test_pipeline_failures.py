"""A pipeline that fails ends every rank with an error that names the cause, within seconds.

`tests/test_pipeline.py` checks that a raising stage and a schedule mismatch end the simulated ranks.
Here: a schedule mismatch names the message each stage waits for (its action and micro-batch), and
under gloo a stage that raises is what the caller sees, with that rank's traceback: its peers' failed
sends are consequences (before, rank 0's "Connection closed by peer", raised while its pipeline step
flushed its sends, hid rank 1's error).
"""
from __future__ import annotations

import time

import pytest

import globaltensor as gt
from test_pipeline import _failing


def test_a_schedule_mismatch_names_the_messages_each_stage_awaits():
    t0 = time.perf_counter()
    with pytest.raises(gt.CollectiveError) as err:
        gt.launch(_failing, 2, args=("mismatch", "1f1b"), timeout=20)
    assert time.perf_counter() - t0 < 10  # the scheduler sees both ranks blocked: no timeout needed
    msg = str(err.value)
    assert "rank 0 waits in send_recv from rank 1 (backward of micro-batch 0)" in msg
    assert "rank 1 waits in send_recv from rank 0 (forward of micro-batch 0)" in msg


@pytest.mark.gloo
def test_a_stage_raising_under_gloo_is_what_the_caller_sees():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="stage 1 broke") as err:
        gt.launch(_failing, 2, args=("raise", "1f1b"), backend="gloo", timeout=30)
    assert time.perf_counter() - t0 < 30
    assert err.value.rank == 1 and any("raised on rank 1" in n for n in err.value.__notes__)
