"""ZeRO side by side: globaltensor's ZeRO-2/3 (a plan) vs torch FSDP2 `fully_shard` and DDP.

    python bench/zero.py            # the GPT of the tests and a wider one (~50M parameters), 4 gloo ranks
    python bench/zero.py --quick    # a smoke run

Every implementation trains the same `models/gpt.py` GPT (fp32, AdamW foreach, same seed and batches)
on the same 4 gloo processes, interleaved step by step in one launch (each step between barriers, a
fresh random order per repetition; a step's time is its slowest rank's):

- gt ZeRO-3 / ZeRO-2: `gt.to_global(model, placement, zero_plan(0, 1, reshard_after_forward=...))`,
  batch `S(0)`; the unchanged optimizer updates the `S(0)` shards.
- FSDP2 / FSDP2 no-reshard: `fully_shard` on each block, then on the root (its wte/wpe/ln_f and the
  tied head), `reshard_after_forward` True (ZeRO-3) or False (ZeRO-2); each rank its batch slice.
- DDP: `DistributedDataParallel`, for reference (parameters and optimizer state replicated).

Bytes received per rank per step: ours counted by `gt.comm_log()` (rank 0); FSDP2's worked out from
its design (each parameter's dim 0 padded to a multiple of the ranks, all-gathered forward, again
backward with reshard, reduce-scattered backward) and DDP's as one all-reduce of every gradient.
Peak memory: a separate launch per implementation, VmHWM growth from just before building the model
(`/proc/self/clear_refs`), max over ranks: parameters, gradients, optimizer state, gathered copies,
activations and the collectives' buffers (the backend's own copies among them). glibc's mmap threshold
is fixed at 64 KiB in those launches (`MALLOC_MMAP_THRESHOLD_`), so that a freed tensor leaves resident
memory and the peak counts live bytes, not the heap's fragmentation (glibc's default threshold grows
to 32 MiB as large blocks are freed, after which freed tensors stay resident in a way that depends on
the order of allocations; `--allocator-slack` keeps the default, as the runs before session 7 did). Model-state bytes: local shards of parameters, gradients
and AdamW moments, max over ranks.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import warnings
from functools import partial

import torch
import torch.distributed as dist

import globaltensor as gt
from common import build_and_time, paired_ratio, paired_ratio_ci, write_results
from globaltensor.models.gpt import GPT, GPTConfig, zero_plan
from train_step import _reset_peak, _status, batches

IMPLS = ("gt ZeRO-3", "FSDP2", "gt ZeRO-2", "FSDP2 no-reshard", "DDP")
PAIRS = (("gt ZeRO-3", "FSDP2"), ("gt ZeRO-2", "FSDP2 no-reshard"))


class GlobalTensorZero:
    def __init__(self, cfg: GPTConfig, n: int, lr: float, seed: int, reshard: bool) -> None:
        self.p = gt.placement("cpu", list(range(n)))
        torch.manual_seed(seed)
        self.model = gt.to_global(GPT(cfg), self.p, zero_plan(0, 1, reshard_after_forward=reshard))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=True)
        self.losses, self.bytes = [], []

    def step(self, idx: torch.Tensor, tgt: torch.Tensor) -> None:
        with gt.comm_log() as log:
            idx, tgt = gt.to_global(idx, self.p, gt.split(0)), gt.to_global(tgt, self.p, gt.split(0))
            _, loss = self.model(idx, tgt)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        self.bytes.append(log.recv_bytes)
        self.losses.append(loss.detach())

    def loss_values(self) -> list[float]:
        return [x.full_tensor().item() for x in self.losses]

    def state_bytes(self) -> int:
        return sum(t._local.nbytes for q in self.model.parameters()
                   for t in [q] + [v for v in self.opt.state[q].values() if torch.is_tensor(v) and v.dim()])

    def step_bytes(self) -> int | None:
        return self.bytes[-1]


class TorchData:
    """FSDP2 or DDP: each rank trains on its slice of the batch; the loss is averaged over ranks."""

    def __init__(self, cfg: GPTConfig, n: int, lr: float, seed: int, kind: str) -> None:
        torch.manual_seed(seed)
        self.model, self.n, self.kind = GPT(cfg), n, kind
        self.rank = dist.get_rank()
        full = [(p.shape, p.element_size()) for p in self.model.parameters()]
        if kind == "DDP":
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(self.model)
            self.expected = sum(2 * (n - 1) * math.prod(s) * e // n for s, e in full)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (n,))
            reshard = kind == "FSDP2"
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)
            padded = sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) * e for s, e in full)
            self.expected = (3 if reshard else 2) * padded * (n - 1) // n
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=True)
        self.losses = []

    def step(self, idx: torch.Tensor, tgt: torch.Tensor) -> None:
        rows = idx.shape[0] // self.n
        sl = slice(self.rank * rows, (self.rank + 1) * rows)
        _, loss = self.model(idx[sl], tgt[sl])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.detach())

    def loss_values(self) -> list[float]:
        local = torch.stack(self.losses)
        dist.all_reduce(local)
        return (local / self.n).tolist()

    def state_bytes(self) -> int:
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        return sum(local(t).nbytes for q in self.model.parameters()
                   for t in [q] + [v for v in self.opt.state[q].values() if torch.is_tensor(v) and v.dim()])

    def step_bytes(self) -> int | None:
        return self.expected


def build(impl: str, cfg: GPTConfig, n: int, lr: float, seed: int):
    if impl.startswith("gt"):
        return GlobalTensorZero(cfg, n, lr, seed, reshard=impl == "gt ZeRO-3")
    return TorchData(cfg, n, lr, seed, impl)


def timed(cfg: GPTConfig, batch: int, reps: int, warmup: int, lr: float, seed: int, threads: int):
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    n = dist.get_world_size()
    data = batches(cfg, batch, 1 + warmup + reps)
    live, times, errors = build_and_time({k: partial(build, k, cfg, n, lr, seed) for k in IMPLS}, data, reps, warmup)
    state: list = [None] * n
    dist.all_gather_object(state, {k: t.state_bytes() for k, t in live.items()})
    losses = {k: t.loss_values() for k, t in live.items()}
    if dist.get_rank() != 0:
        return None
    return {"times": times, "losses": losses, "errors": errors,
            "state_bytes": {k: max(s[k] for s in state) for k in live},
            "step_bytes": {k: t.step_bytes() for k, t in live.items()}}


def peak_memory(impl: str, cfg: GPTConfig, batch: int, steps: int, lr: float, seed: int, threads: int):
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    data = batches(cfg, batch, steps)
    dist.barrier()
    _reset_peak()
    base = _status("VmRSS")
    t = build(impl, cfg, dist.get_world_size(), lr, seed)
    for i in range(steps):
        t.step(*data[i])
    peak = _status("VmHWM") - base
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peak)
    return max(gathered) if dist.get_rank() == 0 else None


def run(name: str, cfg: GPTConfig, args) -> dict:
    res = gt.launch(timed, args.ranks, backend="gloo", timeout=1800,
                    args=(cfg, args.batch, args.reps, args.warmup, args.lr, args.seed, args.threads))[0]
    res["config"] = name
    res["params"] = sum(p.numel() for p in GPT(cfg).parameters())
    res["memory"] = {}
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if not args.allocator_slack:  # read by the spawned ranks' glibc at start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    for impl in IMPLS:
        if impl in res["errors"]:
            continue
        try:
            res["memory"][impl] = gt.launch(peak_memory, args.ranks, backend="gloo", timeout=1800,
                                            args=(impl, cfg, args.batch, args.mem_steps, args.lr, args.seed,
                                                  args.threads))[0]
        except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not crash
            res["errors"][impl] = f"memory launch failed: {type(e).__name__}: {e}"
    if saved is None:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return res


def report(results: list[dict], args) -> str:
    lines = [f"ZeRO on {args.ranks} gloo processes ({platform.node()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}), fp32, AdamW foreach, global batch {args.batch}; medians of {args.reps} "
             f"interleaved steps after {args.warmup + 1} warm-up; ratios: medians of per-step ratios with ~95% "
             "intervals", ""]
    for res in results:
        t = res["times"]
        med = {k: statistics.median(v) for k, v in t.items()}
        lines += [f"**{res['config']}** ({res['params'] / 1e6:.2f}M parameters)", "",
                  "| implementation | ms/step | bytes recv/rank/step | model state MiB/rank | peak RSS growth "
                  f"MiB/rank{' (default malloc)' if args.allocator_slack else ''} | final loss |",
                  "|---|---|---|---|---|---|"]
        for k in IMPLS:
            if k in res["errors"]:
                lines.append(f"| {k} | failed: {res['errors'][k]} | | | | |")
                continue
            mem = res["memory"].get(k)
            lines.append(f"| {k} | {med[k] * 1e3:.1f} | {res['step_bytes'][k]:,} | "
                         f"{res['state_bytes'][k] / 2**20:.2f} | {'—' if mem is None else f'{mem / 2**20:.1f}'} | "
                         f"{res['losses'][k][-1]:.5f} |")
        lines.append("")
        for a, b in PAIRS:
            if a in t and b in t:
                lo, hi = paired_ratio_ci(t, a, b)
                ma, mb = res["memory"].get(a), res["memory"].get(b)
                mem = f"; peak memory {ma / mb:.2f}x" if ma and mb else ""
                diff = max(abs(x - y) for x, y in zip(res["losses"][a], res["losses"][b]))
                lines.append(f"- {a} / {b}: step time {paired_ratio(t, a, b):.2f} ({lo:.2f}-{hi:.2f}){mem}; "
                             f"max loss difference over the run {diff:.1e}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["small", "wide"], default=None, help="one of the two models")
    ap.add_argument("--allocator-slack", action="store_true",
                    help="peak memory with glibc's default (growing) mmap threshold: counts heap fragmentation too")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    configs = [("GPT (tests' size)", GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)),
               ("wide GPT", GPTConfig(vocab_size=4096, block_size=64, n_layer=4, n_head=16, n_embd=1024))]
    if args.quick:
        args.reps, args.warmup, args.mem_steps = 3, 0, 1
        configs = configs[:1]
    if args.only:
        configs = [configs[0 if args.only == "small" else 1]]
    results = [run(name, cfg, args) for name, cfg in configs]
    table = report(results, args)
    print(table)
    write_results(args.out, "zero", table, results)


if __name__ == "__main__":
    main()
