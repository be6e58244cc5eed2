"""gloo's own reduce-scatter and all-gather against the forms globaltensor runs on gloo.

    python bench/collectives.py                    # 2 and 4 gloo processes, 4 and 48 MiB
    python bench/collectives.py --ranks 4 --mib 48

On gloo a reduce-scatter is an all-reduce of a copy of the input (each rank receives twice the
textbook bytes), and an all-gather relays every piece round a ring through a flat buffer of its own,
then copies it out. `runtime/dist.py` runs a reduce-scatter as an all-to-all plus a local sum, and
an all-gather of at least `GLOO_SENDS_FROM_BYTES` as one send per peer into the output. Here each
pair runs interleaved (fresh random order per repetition, between barriers; a repetition's time is
its slowest rank's): torch.distributed's call against `gt`'s communicator on the same tensors. CPU
time is the process's (gloo's threads included), max over ranks; results checked equal.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import globaltensor as gt
from common import paired_ratio, paired_ratio_ci, write_results
from globaltensor.runtime import context

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def measure(mib: float, reps: int, warmup: int) -> dict:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    comm, group = context.current(), tuple(range(n))
    numel = int(mib * 2**20 / 4) // n * n
    torch.manual_seed(rank)
    x = torch.randn(numel)
    chunks = list(x.chunk(n))
    shard = x[: numel // n].clone()
    out, full = torch.empty(numel // n), torch.empty(numel)
    impls = {
        ("reduce_scatter", "gloo"): lambda: _reduce_scatter(out, x),
        ("reduce_scatter", "gt"): lambda: comm.reduce_scatter(chunks, group),
        ("all_gather", "gloo"): lambda: _all_gather(full, shard),
        ("all_gather", "gt"): lambda: comm.all_gather(shard, group),
    }
    _reduce_scatter(out, x)
    assert torch.allclose(out, comm.reduce_scatter(chunks, group), rtol=1e-5, atol=1e-5)
    _all_gather(full, shard)
    assert torch.equal(full, torch.cat(comm.all_gather(shard, group)))
    wall = {k: [] for k in impls}
    cpu = {k: [] for k in impls}
    order = list(impls)
    shuffle = __import__("random").Random(0).shuffle
    for rep in range(warmup + reps):
        shuffle(order)
        for k in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            impls[k]()
            dist.barrier()
            if rep >= warmup:
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    gathered: list = [None] * n
    dist.all_gather_object(gathered, (wall, cpu))
    if rank:
        return {}
    return {f"{k[0]} {k[1]}": ([max(g[0][k][i] for g in gathered) for i in range(reps)],
                               [max(g[1][k][i] for g in gathered) for i in range(reps)]) for k in impls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=float, nargs="+", default=[4, 48])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    lines = [f"gloo collectives ({platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}), fp32, one "
             f"thread per process; medians of {args.reps} interleaved calls after {args.warmup} warm-up; the "
             "input buffer's size per rank; ratios: medians of per-call ratios with ~95% intervals", "",
             "| collective | ranks | MiB | gloo ms | gt ms | gt / gloo time | gloo CPU ms | gt CPU ms | gt / gloo CPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    raw = []
    for n in args.ranks:
        for mib in args.mib:
            res = gt.launch(measure, n, backend="gloo", args=(mib, args.reps, args.warmup))[0]
            raw.append({"ranks": n, "mib": mib, "results": res})
            for kind in ("reduce_scatter", "all_gather"):
                a, b = f"{kind} gt", f"{kind} gloo"
                wall = {k: v[0] for k, v in res.items()}
                cpu = {k: v[1] for k, v in res.items()}
                lo, hi = paired_ratio_ci(wall, a, b)
                clo, chi = paired_ratio_ci(cpu, a, b)
                size = mib if kind == "reduce_scatter" else mib / n  # all-gather: the shard each rank gives
                lines.append(f"| {kind} | {n} | {size:g} | {statistics.median(wall[b]) * 1e3:.1f} | "
                             f"{statistics.median(wall[a]) * 1e3:.1f} | {paired_ratio(wall, a, b):.2f} "
                             f"({lo:.2f}-{hi:.2f}) | {statistics.median(cpu[b]) * 1e3:.1f} | "
                             f"{statistics.median(cpu[a]) * 1e3:.1f} | {paired_ratio(cpu, a, b):.2f} ({clo:.2f}-{chi:.2f}) |")
    table = "\n".join(lines)
    print(table)
    write_results(args.out, "collectives", table, raw)


if __name__ == "__main__":
    main()
