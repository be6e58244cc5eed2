"""Step plans: what recording and solving a step costs, and what a steered step saves.

    python bench/step_plan.py            # GPT with every parameter S(0), 2 and 8 layers, 2 gloo processes
    python bench/step_plan.py --quick

The model: `models/gpt.py`'s GPT with every parameter `S(0)` and the batch `S(0)` (no module hints: a
layout a user might write first), AdamW foreach. Per configuration, on the same processes:

- record: the first step under `gt.step_plan()` (decided op by op while every call's valid choices are
  written down) and the solve when it ends, against a step without a plan (its time is the overhead);
- bytes received per rank per step, op by op and steered (`gt.comm_log()`, exact);
- step time op by op and steered, interleaved step by step (`common.interleaved_times`), with the
  ratio's ~95% interval. The two compute the same values.
"""
from __future__ import annotations

import argparse
import os
import platform
import time
import warnings

import torch
import torch.distributed as dist

import globaltensor as gt
from common import interleaved_times, paired_ratio, paired_ratio_ci, write_results
from globaltensor.models.gpt import GPT, GPTConfig


class Step:
    def __init__(self, cfg: GPTConfig, batch: int, seed: int) -> None:
        n = dist.get_world_size()
        torch.manual_seed(seed)
        self.p = gt.placement("cpu", list(range(n)))
        self.model = gt.to_global(GPT(cfg), self.p, {"*": gt.split(0)})
        g = torch.Generator().manual_seed(seed + 1)
        self.idx, self.tgt = (gt.to_global(torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g),
                                           self.p, gt.split(0)) for _ in range(2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)

    def __call__(self) -> int:
        with gt.comm_log() as log:
            _, loss = self.model(self.idx, self.tgt)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        return log.recv_bytes


def measure(cfg: GPTConfig, batch: int, reps: int, warmup: int, seed: int) -> dict:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    plain, planned = Step(cfg, batch, seed), Step(cfg, batch, seed)
    plan = gt.step_plan()

    def steered() -> int:
        with plan:
            return planned()

    plain_bytes = plain()          # AdamW creates its state in the first step: outside the measurement
    planned()
    dist.barrier()
    t0 = time.perf_counter()
    plain()
    unplanned_s = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    steered()                      # records, then solves on leaving the plan
    record_s = time.perf_counter() - t0
    steered_bytes = steered()
    assert plan.steering, "the second run under the plan left it"
    times = interleaved_times({"op by op": plain, "steered": steered}, reps, warmup)
    assert plan.steering
    return {"calls": len(plan.graph.calls), "record_s": record_s, "unplanned_s": unplanned_s,
            "bytes": (plain_bytes, steered_bytes), "cost": (plan.recorded_cost, plan.solved_cost), "times": times}


def report(rows: list, args) -> str:
    lines = [f"GPT with every parameter S(0), batch {args.batch} S(0), AdamW foreach, {args.ranks} gloo processes "
             f"({platform.node() or 'vm'}, {os.cpu_count()} CPUs, torch {torch.__version__}); {args.reps} interleaved "
             "repetitions after warm-up; ratio: median of per-step ratios, ~95% interval", "",
             "| layers | calls | record + solve s (a step without plan) | bytes recv/rank op by op | steered | "
             "op by op ms | steered ms | steered / op by op |", "|---|---|---|---|---|---|---|---|"]
    for layers, r in rows:
        t = r["times"]
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in t.items()}
        lo, hi = paired_ratio_ci(t, "steered", "op by op")
        lines.append(f"| {layers} | {r['calls']} | {r['record_s']:.2f} ({r['unplanned_s']:.2f}) | {r['bytes'][0]:,} | "
                     f"{r['bytes'][1]:,} | {med['op by op']:.1f} | {med['steered']:.1f} | "
                     f"{paired_ratio(t, 'steered', 'op by op'):.2f} ({lo:.2f}-{hi:.2f}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        args.layers, args.reps = [2], 3
    rows = []
    for layers in args.layers:
        cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=128)
        got = gt.launch(measure, args.ranks, backend="gloo", args=(cfg, args.batch, args.reps, args.warmup, args.seed))
        rows.append((layers, got[0]))
    table = report(rows, args)
    print(table)
    write_results(args.out, "step_plan", table, [(layers, r) for layers, r in rows])


if __name__ == "__main__":
    main()
