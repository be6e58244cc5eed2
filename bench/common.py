"""What every benchmark shares: interleaved timing across ranks and writing results."""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
import traceback
from typing import Any, Callable

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


def paired_ratio_ci(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float]:
    """A distribution-free ~95% interval for `paired_ratio` (order statistics of the sorted ratios).

    The median's rank interval is n/2 -+ 0.98 sqrt(n) (the binomial(n, 1/2) normal approximation);
    a target is only met or missed where the whole interval says so.
    """
    r = sorted(x / y for x, y in zip(times[a], times[b]))
    k = max(0, int((len(r) - 1.96 * math.sqrt(len(r))) / 2))
    return r[k], r[len(r) - 1 - k]


def interleaved_times(impls: dict[str, Callable[[], object]], reps: int, warmup: int,
                      inner: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each implementation in each repetition, run A B C, C A B, ... between barriers.

    A repetition takes as long as its slowest rank; `inner` calls are timed together
    (for per-op overheads far below a barrier's cost) and averaged. Each repetition runs the
    implementations in a fresh random order, the same on every rank: on a shared VM the slot
    after another implementation (its frees, its cache footprint) is not neutral, and a fixed
    order would charge that to whoever always follows. Every rank gets the same lists.
    """
    times: dict[str, list[float]] = {k: [] for k in impls}
    order = list(impls)
    shuffle = random.Random(0).shuffle  # one seed: every rank draws the same orders
    for rep in range(warmup + reps):
        shuffle(order)
        for k in order:
            fn = impls[k]
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


def agree_on_failures(errors: dict[str, str]) -> dict[str, str]:
    """Every rank drops an implementation that failed on any rank (else the next collective hangs)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    out: dict[str, str] = {}
    for r, errs in enumerate(gathered):
        for k, v in errs.items():
            out.setdefault(k, f"rank {r}: {v}")
    return out


def attempt(errors: dict, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None with the failure noted under `name`: a benchmark reports, it does not crash."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if dist.get_rank() == 0:
            traceback.print_exc()
        errors[name] = msg
        return None


def build_and_time(builders: dict[str, Callable[[], Any]], data: list, reps: int,
                   warmup: int) -> tuple[dict[str, Any], dict[str, list[float]], dict[str, str]]:
    """Build each implementation (an object with `step(*batch)`), run one untimed first step each
    (caches, first-call costs), drop everywhere what failed anywhere, then time interleaved steps,
    each on the next batch of `data`. Returns (the live implementations, their times, the failures)."""
    errors: dict[str, str] = {}
    built = {k: attempt(errors, k, build) for k, build in builders.items()}
    errors = agree_on_failures(errors)
    for k, impl in built.items():
        if k not in errors:
            attempt(errors, k, impl.step, *data[0])
    errors = agree_on_failures(errors)
    live = {k: impl for k, impl in built.items() if k not in errors}
    counters = {k: 1 for k in live}

    def stepper(k: str) -> Callable[[], None]:
        def fn() -> None:
            live[k].step(*data[counters[k]])
            counters[k] += 1
        return fn
    times = interleaved_times({k: stepper(k) for k in live}, reps, warmup) if live else {}
    return live, times, errors


def write_results(out_dir: str, stem: str, table: str, data: object) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem)
    with open(path + ".md", "w") as f:
        f.write(table + "\n")
    with open(path + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
