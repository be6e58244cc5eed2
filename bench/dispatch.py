"""Per-op overhead: GlobalTensor vs torch DTensor vs plain torch on the local shard.

    python bench/dispatch.py            # cache hits on 2 gloo processes; cache misses on 1-D and 2x4 meshes
    python bench/dispatch.py --quick

Cache hits: small tensors (8x8), so the time is the framework's, interleaved
(gt, DTensor, torch, ...) in one run. Cache misses: the first call for a shape
never seen before, timed on rank 0 of an 8-rank world made with torch's fake
process group (no other processes needed; neither op communicates).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import globaltensor as gt
from common import interleaved_medians, write_results

OPS = {
    "add": lambda x, w: x + x,
    "mm": lambda x, w: x @ w,
    "relu": lambda x, w: x.relu(),
    "sum": lambda x, w: x.sum(),
    "view": lambda x, w: x.view(x.shape[0], 4, 2),
    "linear fwd+bwd": lambda x, w: F.linear(x, w).sum().backward(),
}


def _inputs(kind: str, ranks: list, shape=(8, 8)):
    """x: split on rows (like a batch), w: replicated (like a weight), in each framework."""
    torch.manual_seed(0)
    xf, wf = torch.randn(shape), torch.randn(shape[1], shape[1])
    if kind == "torch":
        lay = gt.Layout(gt.placement("cpu", ranks), gt.split(0))
        (start, rows), _ = lay.shard(shape, dist.get_rank())
        return xf[start:start + rows].clone(), wf.requires_grad_()
    if kind == "gt":
        p = gt.placement("cpu", ranks)
        return (gt.to_global(xf, p, (gt.split(0),) * p.ndim),
                gt.to_global(wf, p, (gt.broadcast,) * p.ndim).requires_grad_())
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = DeviceMesh("cpu", ranks)
    return (distribute_tensor(xf, mesh, [Shard(0)] * mesh.ndim),
            distribute_tensor(wf, mesh, [Replicate()] * mesh.ndim).requires_grad_())


def cache_hits(reps: int, inner: int) -> list[dict] | None:
    ranks = list(range(dist.get_world_size()))
    inputs = {k: _inputs(k, ranks) for k in ("gt", "dtensor", "torch")}
    rows = []
    for name, op in OPS.items():
        impls = {k: (lambda op=op, a=a: op(*a)) for k, a in inputs.items()}
        for fn in impls.values():
            fn()  # fill the caches
        med = interleaved_medians(impls, reps, warmup=2, inner=inner)
        rows.append({"op": name, **{k: v * 1e6 for k, v in med.items()}})
    return rows if dist.get_rank() == 0 else None


def collective_check(reps: int, inner: int) -> dict | None:
    """What the collective watch (`globaltensor/runtime/watch.py`, on by default on gloo) costs per
    collective: a 1-element all_reduce with the watch on and off, interleaved, and its enter/leave pair
    alone (all it adds while nothing stalls)."""
    from globaltensor.runtime import context
    comm = context.current()
    watch, group, one = comm._watch, tuple(range(dist.get_world_size())), torch.ones(1)

    def with_watch():
        comm._watch = watch
        comm.all_reduce(one, group)

    def without():
        comm._watch = None
        comm.all_reduce(one, group)
    med = interleaved_medians({"on": with_watch, "off": without}, reps, warmup=2, inner=inner)
    comm._watch = watch
    n = 100000
    t0 = time.perf_counter()
    for _ in range(n):
        watch.enter("all_reduce", group, (1, torch.float32, "sum"))
        watch.leave()
    pair = (time.perf_counter() - t0) / n
    out = {"all_reduce_on_us": med["on"] * 1e6, "all_reduce_off_us": med["off"] * 1e6, "enter_leave_us": pair * 1e6}
    return out if dist.get_rank() == 0 else None


def with_collective_check(reps: int, inner: int) -> tuple:
    return cache_hits(reps, inner), collective_check(reps, inner)


def cache_misses(n_shapes: int) -> list[dict]:
    """First-call cost for fresh shapes; one process posing as rank 0 of 8 (torch's fake group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    rows = []
    try:
        for mesh_name, ranks in (("1-D (8)", list(range(8))), ("2x4", [[0, 1, 2, 3], [4, 5, 6, 7]])):
            for opname in ("add", "mm"):
                times: dict[str, list[float]] = {"gt": [], "dtensor": []}
                for k in range(n_shapes):
                    shape = (16, 8 + k)  # a new shape is a new cache key in both frameworks
                    for kind in times:
                        x, w = _inputs(kind, ranks, shape)
                        t0 = time.perf_counter()
                        OPS[opname](x, w)
                        times[kind].append(time.perf_counter() - t0)
                rows.append({"mesh": mesh_name, "op": opname,
                             **{k: statistics.median(v) * 1e6 for k, v in times.items()}})
    finally:
        dist.destroy_process_group()
    return rows


def table(hits: list[dict], misses: list[dict], check: dict | None = None) -> str:
    lines = [f"Dispatch overhead, µs per op (medians; {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__})",
             "", "Cache hit, 2 gloo processes, 8x8 fp32, x S(0), w B:", "",
             "| op | globaltensor | DTensor | torch (local) | gt overhead / DTensor overhead |", "|---|---|---|---|---|"]
    for r in hits:
        over = (r["gt"] - r["torch"]) / max(r["dtensor"] - r["torch"], 1e-9)
        lines.append(f"| {r['op']} | {r['gt']:.1f} | {r['dtensor']:.1f} | {r['torch']:.1f} | {over:.2f} |")
    lines += ["", "Cache miss (first call for a new shape), rank 0 of 8:", "",
              "| mesh | op | globaltensor | DTensor | gt / DTensor |", "|---|---|---|---|---|"]
    for r in misses:
        lines.append(f"| {r['mesh']} | {r['op']} | {r['gt']:.0f} | {r['dtensor']:.0f} | {r['gt'] / r['dtensor']:.2f} |")
    if check:
        lines += ["", "Collective watch (on by default on gloo; GT_CHECK_COLLECTIVES=0 turns it off), 2 gloo processes:", "",
                  "| 1-element all_reduce, watch on | watch off | enter+leave alone |", "|---|---|---|",
                  f"| {check['all_reduce_on_us']:.1f} µs | {check['all_reduce_off_us']:.1f} µs | "
                  f"{check['enter_leave_us']:.2f} µs |"]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        args.reps, args.inner = 3, 20
    hits, check = gt.launch(with_collective_check, 2, backend="gloo", args=(args.reps, args.inner))[0]
    misses = cache_misses(3 if args.quick else 10)
    text = table(hits, misses, check)
    print(text)
    if not args.quick:
        write_results(args.out, "dispatch", text, {"cache_hit_us": hits, "cache_miss_us": misses,
                                                   "collective_check_us": check})
