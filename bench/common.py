"""What every benchmark shares: interleaved timing across ranks and writing results."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable

import torch.distributed as dist


def interleaved_medians(impls: dict[str, Callable[[], object]], reps: int, warmup: int,
                        inner: int = 1) -> dict[str, float]:
    """Median seconds per call of each implementation, run A B C A B C ... between barriers."""
    times = interleaved_times(impls, reps, warmup, inner)
    return {k: statistics.median(v) for k, v in times.items()}


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over repetitions of a's time / b's time in the same repetition.

    Neighbours in an interleaved run share the machine's state, so their ratio
    cancels the load that drifts between repetitions (a shared 2-core VM moves
    medians by 10-20% between runs; paired ratios move far less).
    """
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def interleaved_times(impls: dict[str, Callable[[], object]], reps: int, warmup: int,
                      inner: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each implementation in each repetition, run A B C A B C ... between barriers.

    A repetition takes as long as its slowest rank; `inner` calls are timed together
    (for per-op overheads far below a barrier's cost) and averaged. Every rank gets the same lists.
    """
    times: dict[str, list[float]] = {k: [] for k in impls}
    for rep in range(warmup + reps):
        for k, fn in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            dt = (time.perf_counter() - t0) / inner
            if rep >= warmup:
                times[k].append(dt)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {k: [max(g[k][i] for g in gathered) for i in range(reps)] for k in impls}


def write_results(out_dir: str, stem: str, table: str, data: object) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem)
    with open(path + ".md", "w") as f:
        f.write(table + "\n")
    with open(path + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
