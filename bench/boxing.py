"""Boxing side by side: `x.to_global(...)` vs the raw torch.distributed call(s) vs DTensor's redistribute.

    python bench/boxing.py                 # 4 gloo processes, 4 MiB fp32 tensors
    python bench/boxing.py --ranks 8 --mib 16
    python bench/boxing.py --quick         # a smoke run: small tensors, few repetitions
    python bench/boxing.py --malloc system # glibc's default trimming (see below)

The three implementations are interleaved (A B C A B C ...) in one run, each
repetition between barriers; a repetition's time is the slowest rank's. Times
are medians; ratios are medians of the per-repetition ratios (neighbours in
time share the machine's load). Prints a Markdown table and writes it with a
JSON file under bench/results/.

"raw" is the bare collective on buffers allocated once, working in place
where torch.distributed does. "floor" is what any conversion must do, since it
returns a new global tensor and leaves its input intact: the same collective
into a fresh buffer, plus a copy of the input for in-place collectives
(all_reduce), the pack of strided pieces (S0->S1), the copy of the piece a
rank already holds into its result, and the tensor-subclass wrapper every
global tensor is (DTensor's too; see `floor_op`).

Repetitions run the implementations in a fresh random order. Conversions that
take well under a millisecond are timed `inner` calls at a time (chosen from
the floor's time, the same on every rank), so that a barrier's jitter does not
swamp them. Each ratio comes with a ~95% interval (`paired_ratio_ci`): the
spread of one implementation against itself on this VM is several percent.

Memory: by default the ranks run with glibc told to keep freed memory
(MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_), as jemalloc and tcmalloc, the
allocators PyTorch recommends on CPU, do. With glibc's defaults each 4 MiB
result is returned to the OS when freed and page-faulted in again by the next
call (~1000 faults), and which implementation pays depends on the order of
frees in the interleaved run. All three run under the same setting.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import globaltensor as gt
from common import interleaved_times, paired_ratio, paired_ratio_ci, write_results

S, B, P = gt.split, gt.broadcast, gt.partial_sum
# torch >= 2.12 renamed the single-tensor collectives (the old names warn)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Case:
    name: str
    src_ranks: list
    src: tuple
    dst_ranks: list
    dst: tuple
    dtensor: bool = True  # DTensor can express it (same mesh)


def cases(n: int) -> list[Case]:
    line = list(range(n))
    out = [Case("S0->B", line, (S(0),), line, (B,)),
           Case("P->B", line, (P,), line, (B,)),
           Case("P->S0", line, (P,), line, (S(0),)),
           Case("S0->S1", line, (S(0),), line, (S(1),)),
           Case("B->S0", line, (B,), line, (S(0),)),
           Case("B->P", line, (B,), line, (P,))]
    if n == 4:
        mesh = [[0, 1], [2, 3]]
        out += [Case("(S0,S1)->(S1,S0)", mesh, (S(0), S(1)), mesh, (S(1), S(0))),
                Case("(S0,S0)->(B,S0)", mesh, (S(0), S(0)), mesh, (B, S(0))),
                Case("(P,S1)->(B,S1)", mesh, (P, S(1)), mesh, (B, S(1))),
                Case("[0,1] S0 -> [2,3] S0", [0, 1], (S(0),), [2, 3], (S(0),), dtensor=False)]
    return out


def _groups(p: gt.Placement, axis: int):
    return [dist.new_group(list(g), use_local_synchronization=True) if gt.rank() in g else None
            for g in p.axis_groups(axis)]


def _operands(case: Case, shape: tuple, dtype) -> tuple:
    """What raw_op and floor_op start from: rank, world size, layouts, this rank's shard, a full tensor."""
    rank, n = dist.get_rank(), dist.get_world_size()
    src = gt.Layout(gt.placement("cpu", case.src_ranks), case.src)
    dst = gt.Layout(gt.placement("cpu", case.dst_ranks), case.dst)
    return (rank, n, src, dst, torch.randn(src.local_shape(shape, rank), dtype=dtype),
            torch.randn(shape, dtype=dtype), case.name)


def raw_op(case: Case, shape: tuple, dtype) -> Callable[[], object]:
    """The torch.distributed call(s) that move what the conversion must move, on buffers made once."""
    rank, n, src, dst, local, full, name = _operands(case, shape, dtype)
    if name == "S0->B":
        out = torch.empty(shape, dtype=dtype)
        return lambda: all_gather_single(out, local)
    if name == "P->B":
        return lambda: dist.all_reduce(local)
    if name == "P->S0":
        out = torch.empty(dst.local_shape(shape, rank), dtype=dtype)
        return lambda: reduce_scatter_single(out, local)
    if name == "S0->S1":
        inp = torch.randn(local.numel(), dtype=dtype)
        out = torch.empty(local.numel(), dtype=dtype)
        return lambda: dist.all_to_all_single(out, inp)
    if name == "B->S0":  # basic indexing: the fastest view torch has (narrow takes ~1.7x as long)
        start, size = dst.shard(shape, rank)[0]
        rows = slice(start, start + size)
        return lambda: full[rows].contiguous()
    if name == "B->P":
        return lambda: full.clone() if rank == 0 else torch.zeros_like(full)
    if name == "(S0,S1)->(S1,S0)":  # the off-diagonal ranks swap their blocks
        peer = {1: 2, 2: 1}.get(rank)
        buf = torch.empty_like(local)
        ops = [] if peer is None else [dist.P2POp(dist.isend, local, peer), dist.P2POp(dist.irecv, buf, peer)]
        return lambda: [w.wait() for w in dist.batch_isend_irecv(ops)] if ops else None
    if name == "(S0,S0)->(B,S0)":  # one all-to-all moving exactly the missing quarters
        quarter = shape[0] // 4
        cols = shape[1]
        have = rank  # rank (i, j) holds quarter 2i + j = rank
        need = {2 * (rank % 2), 2 * (rank % 2) + 1}
        send = [quarter * cols if have in {2 * (q % 2), 2 * (q % 2) + 1} and q != rank else 0 for q in range(n)]
        recv = [quarter * cols if q in need and q != rank else 0 for q in range(n)]
        inp = torch.randn(sum(send), dtype=dtype)
        out = torch.empty(sum(recv), dtype=dtype)
        return lambda: dist.all_to_all_single(out, inp, recv, send)
    if name == "(P,S1)->(B,S1)":
        groups = _groups(src.placement, 0)
        g = next(x for x in groups if x is not None)
        return lambda: dist.all_reduce(local, group=g)
    if name == "[0,1] S0 -> [2,3] S0":
        peer = {0: 2, 1: 3, 2: 0, 3: 1}[rank]
        if rank < 2:
            return lambda: dist.send(local, peer)
        buf = torch.empty(dst.local_shape(shape, rank), dtype=dtype)
        return lambda: dist.recv(buf, peer)
    raise KeyError(name)


class Wrapped(torch.Tensor):
    """The least a global tensor can be: a wrapper subclass holding the local shard (as DTensor is)."""

    __slots__ = ["local"]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # never called: the floor runs no op on it
        raise NotImplementedError(func)


def wrapped(local: torch.Tensor, shape: tuple) -> Wrapped:
    w = torch.Tensor._make_wrapper_subclass(Wrapped, shape, dtype=local.dtype, device=local.device)
    w.local = local
    return w


def floor_op(case: Case, shape: tuple, dtype) -> Callable[[], object]:
    """The raw call(s) plus what any conversion must add to return a new global tensor and keep its input.

    A fresh result buffer (the collective receives into it), a copy of the
    input where the collective works in place (all_reduce), the pack of
    strided pieces before an all-to-all, the copy of the piece a rank
    already holds into its result, and the wrapper that makes the shard a
    global tensor.
    """
    op = _floor_local(case, shape, dtype)
    return lambda: wrapped(op(), shape)


def _floor_local(case: Case, shape: tuple, dtype) -> Callable[[], torch.Tensor]:
    """floor_op's shard: the result of this rank's part of the conversion."""
    rank, n, src, dst, local, full, name = _operands(case, shape, dtype)
    if name == "S0->B":
        def gather():
            out = torch.empty(shape, dtype=dtype)
            all_gather_single(out, local)
            return out
        return gather
    if name == "P->B":
        def reduce():
            out = local.clone()
            dist.all_reduce(out)
            return out
        return reduce
    if name == "P->S0":
        def reduce_scatter():
            out = torch.empty(dst.local_shape(shape, rank), dtype=dtype)
            reduce_scatter_single(out, local)
            return out
        return reduce_scatter
    if name == "S0->S1":
        inp = torch.empty(local.numel(), dtype=dtype)
        rows, cols = local.shape[0], shape[1] // n

        def pack_and_send():
            inp.view(n, rows, cols).copy_(local.view(rows, n, cols).transpose(0, 1))
            out = torch.empty((n * rows, cols), dtype=dtype)
            dist.all_to_all_single(out.view(-1), inp)
            return out
        return pack_and_send
    if name == "B->S0":  # basic indexing: the fastest view torch has (narrow takes ~1.7x as long)
        start, size = dst.shard(shape, rank)[0]
        rows = slice(start, start + size)
        return lambda: full[rows]
    if name == "B->P":
        return lambda: full if rank == 0 else torch.zeros_like(full)
    if name == "(S0,S1)->(S1,S0)":
        peer = {1: 2, 2: 1}.get(rank)

        def swap():
            if peer is None:
                return local
            buf = torch.empty_like(local)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, local, peer), dist.P2POp(dist.irecv, buf, peer)]):
                w.wait()
            return buf
        return swap
    if name == "(S0,S0)->(B,S0)":  # receive the missing quarters straight into the half, copy a held one
        quarter = local.shape[0]
        need = [2 * (rank % 2), 2 * (rank % 2) + 1]  # rank q holds quarter q
        got = [q for q in need if q != rank]
        lo = need.index(got[0])
        send = [local.numel() if q % 2 == rank // 2 and q != rank else 0 for q in range(n)]
        recv = [local.numel() if q in got else 0 for q in range(n)]
        inp = torch.cat([local.reshape(-1)] * sum(1 for k in send if k))

        def assemble():
            half = torch.empty((2 * quarter, shape[1]), dtype=dtype)
            dist.all_to_all_single(half[lo * quarter:(lo + len(got)) * quarter].reshape(-1), inp, recv, send)
            if rank in need:
                half[need.index(rank) * quarter:(need.index(rank) + 1) * quarter].copy_(local)
            return half
        return assemble
    if name == "(P,S1)->(B,S1)":
        g = next(x for x in _groups(src.placement, 0) if x is not None)

        def reduce():
            out = local.clone()
            dist.all_reduce(out, group=g)
            return out
        return reduce
    if name == "[0,1] S0 -> [2,3] S0":
        peer = {0: 2, 1: 3, 2: 0, 3: 1}[rank]
        if rank < 2:
            return lambda: dist.send(local, peer) or local.new_empty(0)

        def receive():
            out = torch.empty(dst.local_shape(shape, rank), dtype=dtype)
            dist.recv(out, peer)
            return out
        return receive
    raise KeyError(name)


def gt_op(case: Case, shape: tuple, dtype) -> tuple[Callable[[], object], gt.boxing.Route]:
    p_src, p_dst = gt.placement("cpu", case.src_ranks), gt.placement("cpu", case.dst_ranks)
    lay = gt.Layout(p_src, case.src)
    local = torch.randn(lay.local_shape(shape, gt.rank()), dtype=dtype)
    x = gt.from_local(local, p_src, case.src, shape=shape)
    route = gt.boxing.route(lay, gt.Layout(p_dst, case.dst), shape, dtype)
    return (lambda: x.to_global(p_dst, case.dst)), route


def dtensor_op(case: Case, shape: tuple, dtype) -> Callable[[], object] | None:
    if not case.dtensor:
        return None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    def conv(s):
        return Shard(s.dim) if isinstance(s, gt.Split) else Partial() if isinstance(s, gt.Partial) else Replicate()
    mesh = DeviceMesh("cpu", case.src_ranks)
    lay = gt.Layout(gt.placement("cpu", case.src_ranks), case.src)
    local = torch.randn(lay.local_shape(shape, gt.rank()), dtype=dtype)
    x = DTensor.from_local(local, mesh, [conv(s) for s in case.src], run_check=False, shape=shape,
                           stride=torch.empty(shape).stride())
    dst = [conv(s) for s in case.dst]
    x.redistribute(mesh, dst)  # fails here, not in the timed loop, if DTensor cannot do it
    return lambda: x.redistribute(mesh, dst)


def calls_per_timing(fn: Callable[[], object], target_s: float = 2e-3) -> int:
    """How many calls to time together so that one timing lasts ~target_s on the slowest rank."""
    trials = []
    for _ in range(5):  # the least of several: a rank descheduled once must not set the count
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        trials.append((time.perf_counter() - t0) / 10)
    per_call = torch.tensor([min(trials)])
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)  # every rank must run the same number of calls
    return max(1, min(200, round(target_s / per_call.item())))


def run(n_reps: int, mib: float, warmup: int) -> list[dict]:
    n = dist.get_world_size()
    dtype = torch.float32
    rows = max(4 * n, int((mib * 2 ** 20 / 4) ** 0.5) // (4 * n) * (4 * n))
    shape = (rows, int(mib * 2 ** 20 / 4) // rows // (4 * n) * (4 * n))
    results = []
    for case in cases(n):
        impls: dict[str, Callable] = {}
        g, route = gt_op(case, shape, dtype)
        impls["globaltensor"] = g
        impls["raw"] = raw_op(case, shape, dtype)
        impls["floor"] = floor_op(case, shape, dtype)
        try:
            d = dtensor_op(case, shape, dtype)
        except Exception as e:  # noqa: BLE001 - reported as "n/a" with the reason
            d, why = None, f"{type(e).__name__}: {str(e)[:80]}"
        else:
            why = "" if d is not None else "no cross-mesh redistribute"
        if d is not None:
            impls["dtensor"] = d
        with gt.comm_log() as log:
            g()
        inner = calls_per_timing(impls["floor"])
        times = interleaved_times(impls, n_reps, warmup, inner)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = {f"globaltensor/{k}": paired_ratio(times, "globaltensor", k) for k in impls if k != "globaltensor"}
        intervals = {f"globaltensor/{k}": paired_ratio_ci(times, "globaltensor", k)
                     for k in impls if k != "globaltensor"}
        recv = [0] * n
        dist.all_gather_object(recv, log.recv_bytes)
        lb = route.lower_bound
        results.append({
            "case": case.name, "shape": list(shape), "median_s": med, "paired_ratio": ratios,
            "paired_ratio_ci95": intervals, "calls_per_timing": inner, "dtensor_note": why,
            "recv_bytes_counted": recv, "recv_bytes_route": route.recv_bytes[:n],
            "lower_bound": list(lb)[:n] if lb is not None else None,
            "route": route.explain(),
        })
    return results


def table(results: list[dict], n: int, mib: float, malloc: str) -> str:
    lines = [f"Boxing on {n} gloo processes, fp32 {mib:g} MiB tensors, malloc {malloc}, medians "
             f"({platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__})", "",
             "| conversion | gt ms | raw ms | floor ms | DTensor ms | gt/raw | gt/floor (95% interval) | gt/DTensor "
             "| max recv B/rank | lower bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median_s"]
        g, raw, d = m["globaltensor"], m["raw"], m.get("dtensor")
        floor = m.get("floor", raw)
        q = r["paired_ratio"]
        q_raw, q_d = q["globaltensor/raw"], q.get("globaltensor/dtensor")
        q_floor = q.get("globaltensor/floor", q_raw)
        lo, hi = r["paired_ratio_ci95"]["globaltensor/floor"]
        lb = "n/a (Partial source)" if r["lower_bound"] is None else (
            f"{max(r['lower_bound'])} ({'met' if r['recv_bytes_counted'] == r['lower_bound'] else 'NOT met'})")
        lines.append(f"| {r['case']} | {g * 1e3:.3f} | {raw * 1e3:.3f} | {floor * 1e3:.3f} | "
                     f"{'n/a' if d is None else f'{d * 1e3:.3f}'} | {q_raw:.2f} | {q_floor:.2f} ({lo:.2f}-{hi:.2f}) | "
                     f"{'n/a' if q_d is None else f'{q_d:.2f}'} | {max(r['recv_bytes_counted'])} | {lb} |")
    ratios = [r["paired_ratio"]["globaltensor/dtensor"] for r in results if "dtensor" in r["median_s"]]
    if ratios:
        geo = statistics.geometric_mean(ratios)
        lines += ["", f"gt/DTensor geometric mean: {geo:.2f}"]
    notes = [f"- {r['case']}: DTensor n/a: {r['dtensor_note']}" for r in results if r["dtensor_note"]]
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def main_rank(n_reps: int, mib: float, warmup: int) -> list[dict] | None:
    res = run(n_reps, mib, warmup)
    return res if gt.rank() == 0 else None


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4, choices=[2, 4, 8])
    ap.add_argument("--mib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 KiB, 3 repetitions")
    ap.add_argument("--malloc", choices=["kept", "system"], default="kept",
                    help="kept: glibc keeps freed memory, as jemalloc/tcmalloc do (default); system: glibc's defaults")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        args.mib, args.reps = 1 / 16, 3
    if args.malloc == "kept":  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 30)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(1 << 32)
    res = gt.launch(main_rank, args.ranks, backend="gloo", args=(args.reps, args.mib, 2 if args.quick else 5))[0]
    text = table(res, args.ranks, args.mib, args.malloc)
    print(text)
    write_results(args.out, f"boxing-{args.ranks}ranks-{args.mib:g}MiB-{args.malloc}", text, res)
