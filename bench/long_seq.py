"""Attention over a long sequence split across gloo processes: ring, Ulysses, all-gather-KV vs one process.

    python bench/long_seq.py                  # 2 and 4 processes, sequences 2k-16k, causal
    python bench/long_seq.py --quick          # 2 processes, 2k and 4k
    python bench/long_seq.py --no-causal      # all-gather-KV too (it is offered without causal only)
    python bench/long_seq.py --seqs 16384 --ranks 2 --methods ring,ring-zigzag   # only those rows

    python bench/long_seq.py --gpt            # a GPT training step instead (2 layers, 4 heads of 64, AdamW)

Causal runs add "ring-zigzag": the ring on q, k, v laid out `gt.zigzag(2)` (rank i holding chunks i
and 2n-1-i of 2n), which gives every rank the same causal work where a contiguous split gives the
last rank (2n-1)/n of the mean. `--gpt` times one AdamW step of a 2-layer GPT (n_embd 256, 4 heads
of 64, vocab 512, fp32) on one sequence of `seq` tokens: "ring" (weights Broadcast, tokens
`S(1)`, ring attention), "ring-zigzag" (tokens `gt.zigzag(1)`: every activation stays zigzag) and
"ulysses" (`ulysses_plan`), against one process training the same model.

Every process runs one thread (`torch.set_num_threads(1)`); the baseline is one process holding the
whole sequence. Per method: forward + backward of `F.scaled_dot_product_attention` on q, k, v
`[1, heads, seq, 64]` fp32 split on the sequence (each rank draws its own shard, `gt.from_local`),
the method forced with `gt.attention_method`. Time: the median over repetitions of the slowest
rank's time, methods interleaved between barriers (`bench/common.py`); CPU time: the slowest
rank's median CPU seconds per call (what a loaded machine's wall clock hides); ring waits: the slowest
rank's median seconds per call blocked on the ring's messages (where wall time exceeds CPU time,
whether the ring's steps wait for each other). Peak memory: the high-water
mark of the process's resident memory over one call minus its resident memory before it (Linux
`/proc/self/clear_refs` resets the mark), glibc's mmap threshold fixed so that a freed tensor
leaves resident memory at once. Targets (issue 15) at 16k tokens: ring peak <= 1.2 x (one
process's peak / n); ring time <= 1.3 x (one process's time / n) on 2 processes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks' glibc at start
os.environ.setdefault("GT_CHECK_COLLECTIVES", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import globaltensor as gt  # noqa: E402
from common import interleaved_times, write_results  # noqa: E402
from globaltensor.models.gpt import GPT, GPTConfig, seq_batch, ulysses_plan  # noqa: E402
from globaltensor.ops import ring_attention  # noqa: E402

HEAD_DIM = 64


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def peak_bytes(fn) -> int:
    """Resident memory `fn()` adds at its peak (what it allocates and frees included)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current resident memory
    before = _status("VmRSS:")
    fn()
    return _status("VmHWM:") - before


def _ranks(seq: int, heads: int, methods: list, causal: bool, reps: int, pieces=None) -> dict:
    torch.set_num_threads(1)
    _count_ring_waits()
    if pieces is not None:  # the ring's most pieces per block (ops/ring_attention.py), to compare
        ring_attention.PIECES = pieces
        ring_attention.QUERY_PIECES = min(pieces, ring_attention.QUERY_PIECES)
        ring_attention.FORWARD_PIECES = min(pieces, ring_attention.FORWARD_PIECES)
    n = gt.world_size()
    p = gt.placement("cpu", list(range(n)))
    shape = (1, heads, seq, HEAD_DIM)
    local = (1, heads, seq // n + (gt.rank() < seq % n), HEAD_DIM)
    torch.manual_seed(gt.rank())
    inputs = {sbp: [gt.from_local(torch.randn(local), p, sbp, shape=shape).requires_grad_() for _ in range(3)]
              for sbp in (gt.split(2), gt.zigzag(2))}  # a zigzag shard has the contiguous one's shape

    def step(method):
        q, k, v = inputs[gt.zigzag(2) if method == "ring-zigzag" else gt.split(2)]
        method = "ring" if method == "ring-zigzag" else method

        def run():
            with gt.attention_method(method):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                out.sum().backward()
            for t in (q, k, v):
                t.grad = None
        return run
    cpu: dict = {m: [] for m in methods}
    waits: dict = {m: [] for m in methods}
    impls = {m: _waits_counted(_cpu_timed(step(m), cpu[m]), waits[m]) for m in methods}
    peaks = {}
    for m, fn in impls.items():
        fn()  # decisions made, buffers of gloo set up
        with gt.comm_log() as log:
            peaks[m] = peak_bytes(fn)
        peaks[m] = (peaks[m], log.recv_bytes)
    times = interleaved_times(impls, reps, warmup=0)
    return {m: {"s": statistics.median(times[m]), "cpu": statistics.median(cpu[m][-reps:]), "peak": peaks[m][0],
                "recv": peaks[m][1], "wait": statistics.median(waits[m][-reps:])} for m in methods}


_ring_wait = [0.0]  # seconds this process has spent blocked on the ring's messages


def _count_ring_waits() -> None:
    """Time each finish of a ring message (`ring_attention._pass_on`'s result): the part of a rank's
    wall time that waits for its neighbours (a slower neighbour's step, a message still in flight),
    which is where the wall time of a ring with balanced CPU time goes."""
    real = ring_attention._pass_on

    def pass_on(*args):
        finish = real(*args)

        def waited():
            t0 = time.perf_counter()
            try:
                return finish()
            finally:
                _ring_wait[0] += time.perf_counter() - t0
        return waited
    ring_attention._pass_on = pass_on


def _waits_counted(fn, into: list):
    """fn, noting the seconds each call spent waiting on ring messages (0 for the other methods)."""
    def run():
        w0 = _ring_wait[0]
        fn()
        into.append(_ring_wait[0] - w0)
    return run


def _cpu_timed(fn, into: list):
    """fn, noting the CPU seconds this process spends in each call (its gloo threads included): the
    work a rank does, which a loaded machine's wall clock does not show."""
    def run():
        t0 = time.process_time()
        fn()
        into.append(time.process_time() - t0)
    return run


def _alone(seq: int, heads: int, causal: bool, reps: int) -> dict:
    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, heads, seq, HEAD_DIM).requires_grad_() for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        for t in (q, k, v):
            t.grad = None
    cpu: list = []
    timed = _cpu_timed(run, cpu)
    timed()
    peak = peak_bytes(timed)
    times = interleaved_times({"one": timed}, reps, warmup=0)
    return {"s": statistics.median(times["one"]), "cpu": statistics.median(cpu[-reps:]), "peak": peak}


def _gpt_config(seq: int, heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=512, block_size=seq, n_layer=2, n_head=heads, n_embd=heads * HEAD_DIM)


def _gpt_step(model, idx, tgt, method: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run():
        with gt.attention_method(method):
            loss = model(idx, tgt)[1]
            opt.zero_grad()
            loss.backward()
        opt.step()
    return run


def _gpt_ranks(seq: int, heads: int, methods: list, causal: bool, reps: int) -> dict:
    """One AdamW step per method on a GPT over `seq` tokens split on the ranks (see the module's text)."""
    torch.set_num_threads(1)
    _count_ring_waits()
    p = gt.placement("cpu", list(range(gt.world_size())))
    cfg = _gpt_config(seq, heads)
    torch.manual_seed(0)
    tokens = [torch.randint(0, cfg.vocab_size, (1, seq)) for _ in range(2)]
    steps = {}
    for m in methods:
        torch.manual_seed(1)
        plan, sbp = ({}, gt.split(1)) if m == "ring" else ({}, gt.zigzag(1)) if m == "ring-zigzag" else \
            (ulysses_plan(0, 1), seq_batch(0, 1))
        model = gt.to_global(GPT(cfg), p, plan)
        idx, tgt = (gt.to_global(t, p, sbp) for t in tokens)
        steps[m] = _gpt_step(model, idx, tgt, "auto" if m == "ulysses" else "ring")
    return _measure(steps, reps)


def _measure(steps: dict, reps: int) -> dict:
    cpu: dict = {m: [] for m in steps}
    waits: dict = {m: [] for m in steps}
    impls = {m: _waits_counted(_cpu_timed(fn, cpu[m]), waits[m]) for m, fn in steps.items()}
    peaks = {}
    for m, fn in impls.items():
        fn()  # decisions made, buffers of gloo set up, optimizer state allocated
        with gt.comm_log() as log:
            peaks[m] = (peak_bytes(fn), log.recv_bytes)
    times = interleaved_times(impls, reps, warmup=0)
    return {m: {"s": statistics.median(times[m]), "cpu": statistics.median(cpu[m][-reps:]), "peak": peaks[m][0],
                "recv": peaks[m][1], "wait": statistics.median(waits[m][-reps:])} for m in steps}


def _gpt_alone(seq: int, heads: int, causal: bool, reps: int) -> dict:
    torch.set_num_threads(1)
    cfg = _gpt_config(seq, heads)
    torch.manual_seed(0)
    idx, tgt = (torch.randint(0, cfg.vocab_size, (1, seq)) for _ in range(2))
    torch.manual_seed(1)
    return _measure({"one": _gpt_step(GPT(cfg), idx, tgt, "auto")}, reps)["one"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--gpt", action="store_true", help="a GPT training step instead of attention alone")
    ap.add_argument("--seqs", default="2048,4096,8192,16384")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pieces", type=int, default=None,
                    help="ring attention's most key/value pieces per block in the backward (ops/ring_attention.PIECES; "
                         "the query and forward counts at most this too: 1 is the whole-block ring)")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the methods (default: all)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    seqs = [2048, 4096] if args.quick else [int(s) for s in args.seqs.split(",")]
    ranks = [2] if args.quick else [int(r) for r in args.ranks.split(",")]
    causal = not args.no_causal or args.gpt  # the GPT is causal
    methods = ["ring", "ulysses"] + (["ring-zigzag"] if causal else ["allgather"])
    if args.methods:
        wanted = args.methods.split(",")
        unknown = set(wanted) - set(methods)
        if unknown:
            ap.error(f"--methods: {sorted(unknown)} not among {methods} for this run")
        methods = [m for m in methods if m in wanted]
    ranks_fn, alone_fn = (_gpt_ranks, _gpt_alone) if args.gpt else (_ranks, _alone)
    rows, data = [], []
    for seq in seqs:
        one = gt.launch(alone_fn, 1, backend="gloo", args=(seq, args.heads, causal, args.reps))[0]
        for n in ranks:
            extra = () if args.gpt else (args.pieces,)
            res = gt.launch(ranks_fn, n, backend="gloo", args=(seq, args.heads, methods, causal, args.reps) + extra)
            for m in methods:
                s = max(r[m]["s"] for r in res)
                cpu = max(r[m]["cpu"] for r in res)
                peak = max(r[m]["peak"] for r in res)
                recv = max(r[m]["recv"] for r in res)
                wait = max(r[m]["wait"] for r in res)
                rows.append(f"| {seq} | {n} | {m} | {s * 1e3:.0f} | {s / (one['s'] / n):.2f} | "
                            f"{cpu / (one['cpu'] / n):.2f} | {wait * 1e3:.0f} | {peak / 2**20:.1f} | "
                            f"{peak / (one['peak'] / n):.2f} | {recv / 2**20:.1f} |")
                data.append({"seq": seq, "ranks": n, "method": m, "s": s, "cpu": cpu, "peak": peak, "recv": recv,
                             "wait": wait, "one_s": one["s"], "one_cpu": one["cpu"], "one_peak": one["peak"]})
            print(rows[-len(methods):], f"one process: {one['s'] * 1e3:.0f} ms, {one['peak'] / 2**20:.1f} MiB",
                  flush=True)
        rows.append(f"| {seq} | 1 | one process | {one['s'] * 1e3:.0f} | n | n | 0 | {one['peak'] / 2**20:.1f} | "
                    f"n | 0 |")
    what = ("GPT training step (2 layers, vocab 512, AdamW)" if args.gpt else "attention forward + backward")
    table = "\n".join([f"heads {args.heads}, head_dim {HEAD_DIM}, fp32, {'causal' if causal else 'not causal'}, "
                       f"{what}, one thread per process",
                       "",
                       "| seq | procs | method | ms | time / (one process / n) | CPU time / (one process / n) | "
                       "ring waits ms | peak MiB | peak / (one process / n) | MiB received |",
                       "|---|---|---|---|---|---|---|---|---|---|"] + rows)
    print(table)
    write_results(args.out, "long_seq_gpt" if args.gpt else f"long_seq{'' if causal else '_nocausal'}", table, data)


if __name__ == "__main__":
    main()
