"""Pipeline schedules side by side: gt.Pipeline vs torch.distributed.pipelining, same split, same schedule.

    python bench/pipeline.py            # 2 stages on 2 gloo processes, m = 4 and 8, GPipe, 1F1B, interleaved
    python bench/pipeline.py --size wide
    python bench/pipeline.py --quick

The GPT (`models/gpt.py`) split in two: the embeddings and the first half of the blocks on stage 0,
the rest, the final norm and the head on stage 1 (blocks split evenly, so compute per stage is
balanced up to the embedding/head). Both run the same schedule on the same micro-batches and AdamW
(foreach, as torch.optim does on GPUs and `bench/zero.py` here),
interleaved step by step in one launch (each step between barriers, a fresh random order per
repetition; a step's time is its slowest rank's):

- gt: `gt.to_global(model, stage0, pp_plan(stages, n_layer, tied_head=False))`, `gt.Pipeline(model, m,
  schedule, loss_fn)` on `GPTConfig(tied_head=False)`: the head has its own weight, stored on the last
  stage, as torch's stages have it (the same split model as torch's); every rank runs the global program.
- gt replay: the same with `Pipeline(replay=True)`: from the fourth step each rank runs its recorded part
  of each micro-batch (`globaltensor/parallel/replay.py`); timed steps are replayed ones (the bench asserts it).
- gt tied replay (`--tied`): the GPT as written (`pp_plan(stages, n_layer)`), the head's weight tied to the
  embedding: it goes to the last stage once per step and its gradient, summed over the micro-batches, comes
  back (the global program's one parameter; a model torch.pipelining cannot run), with `replay=True` (the
  first stages replay from the fifth step: their first recording still calls the head).
- torch: `PipelineStage` per rank on hand-split stage modules (`ScheduleGPipe` / `Schedule1F1B`, and
  `ScheduleInterleaved1F1B` with two stages per rank); the head gets its own copy of the embedding
  weight (torch's pipelining cannot tie across stages).

Interleaved: two chunks per stage (`pp_plan(virtual=2)`, one block each), theory bubble
(p-1)/(vm+p-1).

Reported: ms per step, the ratio (median of per-step ratios, ~95% interval), the CPU time per step
summed over the ranks' processes (every thread: fibers and gloo's too; robust where other load on the
machine makes wall times noisy) and its ratio likewise, the theoretical bubble
fraction (p-1)/(m+p-1), gt's measured one per rank (`Pipeline.bubble`: the time waiting on other stages inside
the actions plus all the time outside them, over the step; median over steps), torch.pipelining's measured the
same way (the share of its schedule's step outside its stages' `forward_one_chunk`, `backward_one_chunk` and
`_maybe_compute_loss`: what the machine gives a schedule, beside the theory), micro-batches in flight per stage (gt's measured
maximum: GPipe holds m, 1F1B at most p - stage), the peak bytes autograd saved per stage in one
more step (`Pipeline(measure_activations=True)`), and an SVG timeline of the last step per schedule
(`results/pipeline_<schedule>_m<m>.svg`: which rank ran which action when, from real timestamps).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt
from common import interleaved_times, paired_ratio, paired_ratio_ci, write_results
from globaltensor.models.gpt import GPT, GPTConfig, pp_plan
from globaltensor.parallel.pipeline import timeline_svg
from train_step import batches


def loss_fn(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


VIRTUAL = 2  # chunks per stage for the interleaved schedule


class GlobalTensorPipe:
    def __init__(self, cfg: GPTConfig, m: int, kind: str, seed: int, tied: bool, replay: bool = False) -> None:
        n = dist.get_world_size()
        self.stages = [gt.placement("cpu", [r]) for r in range(n)]
        torch.manual_seed(seed)
        virtual = VIRTUAL if kind == "interleaved" else 1
        self.model = gt.to_global(GPT(dataclasses.replace(cfg, tied_head=tied)), self.stages[0],
                                  pp_plan(self.stages, cfg.n_layer, virtual=virtual, tied_head=tied))
        self.pipe = gt.Pipeline(self.model, microbatches=m, schedule=kind, loss_fn=loss_fn, replay=replay)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.bubbles: list = []
        self.replayed: list = []

    def step(self, x, t) -> None:
        self.pipe.step(x, t)
        self.bubbles.append(self.pipe.bubble)
        self.replayed.append(self.pipe.replaying)
        self.opt.step()
        self.opt.zero_grad()


class _Stage(nn.Module):
    """One stage of a hand-split GPT: embeddings (first), blocks, final norm and head (last)."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.wte, self.wpe, self.drop = (gpt.wte, gpt.wpe, gpt.drop) if first else (None, None, None)
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f = gpt.ln_f
            self.head = nn.Linear(gpt.head.in_features, gpt.head.out_features, bias=False)
            self.head.weight = nn.Parameter(gpt.head.weight.detach().clone())  # untied: another stage

    def forward(self, x):
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x)) if self.last else x


class TorchPipe:
    def __init__(self, cfg: GPTConfig, m: int, kind: str, seed: int) -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)
        n, r = dist.get_world_size(), dist.get_rank()
        torch.manual_seed(seed)
        gpt = GPT(cfg)
        v = VIRTUAL if kind == "interleaved" else 1
        per = [i * cfg.n_layer // (n * v) for i in range(n * v + 1)]  # as pp_plan splits the blocks
        chunks = [c * n + r for c in range(v)]                         # virtual stage c * n + r on rank r
        self.stage_modules = nn.ModuleList(_Stage(gpt, per[vs], per[vs + 1], vs == 0, vs == n * v - 1)
                                           for vs in chunks)
        stages = [PipelineStage(mod, vs, n * v, torch.device("cpu")) for mod, vs in zip(self.stage_modules, chunks)]
        if kind == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
        else:
            self.schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stages[0], n_microbatches=m,
                                                                                   loss_fn=loss_fn)
        self.opt = torch.optim.AdamW(self.stage_modules.parameters(), lr=1e-3, foreach=True)
        self.first, self.last = r == 0, r == n - 1
        # its bubble as gt's is measured: the share of the schedule's step not spent computing a chunk's
        # forward, backward or loss (torch's sends, receives and waits happen between those calls)
        self.busy, self.bubbles = 0.0, []
        for obj, names in [(st, ("forward_one_chunk", "backward_one_chunk")) for st in stages] + [
                (self.schedule, ("_maybe_compute_loss",))]:
            for name in names:
                setattr(obj, name, self._timed(getattr(obj, name)))

    def _timed(self, f):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0
        return timed

    def step(self, x, t) -> None:
        self.busy, t0 = 0.0, time.perf_counter()
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=t, losses=[])
        else:
            self.schedule.step()
        self.bubbles.append(1 - self.busy / (time.perf_counter() - t0))
        self.opt.step()
        self.opt.zero_grad()


def timed(cfg: GPTConfig, m: int, kind: str, batch: int, reps: int, warmup: int, seed: int, tied: bool):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    data = batches(cfg, batch, 1)[0]
    impls = {"gt": GlobalTensorPipe(cfg, m, kind, seed, tied=False),
             "gt replay": GlobalTensorPipe(cfg, m, kind, seed, tied=False, replay=True),
             "torch.pipelining": TorchPipe(cfg, m, kind, seed)}
    if tied:
        impls["gt tied replay"] = GlobalTensorPipe(cfg, m, kind, seed, tied=True, replay=True)
    replaying = [k for k in impls if k.endswith("replay")]
    for _ in range(4):  # untimed: the first step runs the program whole, the next ones record
        for k in replaying:
            impls[k].step(*data)
    cpu: dict = {k: [] for k in impls}  # this process's CPU seconds per step (all its threads: fibers, gloo's)

    def stepped(k, v):
        c0 = time.process_time()
        v.step(*data)
        cpu[k].append(time.process_time() - c0)
    times = interleaved_times({k: (lambda k=k, v=v: stepped(k, v)) for k, v in impls.items()}, reps, warmup)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: c[warmup:] for k, c in cpu.items()})
    cpu = {k: [sum(e[k][i] for e in every) for i in range(reps)] for k in impls}  # summed over the ranks
    ours = impls["gt replay"]
    for k in replaying:
        assert all(impls[k].replayed[4:]), f"{k} did not replay every timed step: {impls[k].pipe.replay_why}"
    # one more step, untimed, counting the bytes autograd saves (saved-tensor hooks cost a little time)
    probe = gt.Pipeline(ours.model, microbatches=m, schedule=kind, loss_fn=loss_fn, measure_activations=True)
    probe.step(*data)
    ours.opt.zero_grad()
    mine = (ours.pipe.peak_in_flight, statistics.median(ours.bubbles[4 + warmup:]), ours.pipe.timeline,
            probe.activations.peak, statistics.median(impls["torch.pipelining"].bubbles[warmup + 1:]))
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    return (times, cpu, got) if dist.get_rank() == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--size", choices=["small", "wide"], default="small",
                    help="wide: n_embd 512 (compute per op large against the dispatch of each op)")
    ap.add_argument("--layers", type=int, default=None,
                    help="blocks (default: 2 per stage, so that interleaved's two chunks per stage hold one each)")
    ap.add_argument("--micro", default="4,8", help="micro-batch counts, comma-separated")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    ap.add_argument("--tied", action="store_true",
                    help="also gt replay on the GPT as written (the head tied to the embedding)")
    args = ap.parse_args()
    n_embd = 128 if args.size == "small" else 512
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers or 2 * args.ranks, n_head=4, n_embd=n_embd)
    micros = [int(m) for m in args.micro.split(",")]
    if args.quick:
        args.reps, args.warmup, micros = 3, 1, [4]
    p = args.ranks
    lines = [f"Pipeline, GPT (n_layer {cfg.n_layer}, n_embd {cfg.n_embd}), {p} stages on {p} gloo processes "
             f"({platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}), global batch {args.batch}, "
             f"fp32, AdamW foreach; medians of {args.reps} interleaved steps; ratio: median of per-step ratios (~95% "
             "interval); the head untied (the same split model as torch's stages); gt replay: `Pipeline(replay=True)`; "
             "bubbles, micro-batches in flight and timelines are gt replay's" + ("; gt tied replay: the GPT as written, "
                                                                               "replayed" if args.tied else ""),
             "", "| schedule | m | gt replay ms/step | gt ms/step | torch.pipelining ms/step | gt replay / torch | "
             "gt / torch | CPU ms/step, all ranks: gt replay / torch = ratio | "
             + ("gt tied replay / torch | " if args.tied else "") + "theory bubble | gt measured bubble per rank | "
             "torch.pipelining measured bubble per rank | "
             "gt micro-batches in flight per stage | gt peak saved activations per stage (KiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.tied else "")]
    data = []
    name = f"pipeline_{args.size}" + (f"_p{p}" if p != 2 else "")

    def ratio(times: dict, a: str) -> str:
        lo, hi = paired_ratio_ci(times, a, "torch.pipelining")
        return f"{paired_ratio(times, a, 'torch.pipelining'):.2f} ({lo:.2f}-{hi:.2f})"
    for kind in args.schedules.split(","):
        for m in micros:
            times, cpu, got = gt.launch(timed, p, backend="gloo", timeout=1800,
                                        args=(cfg, m, kind, args.batch, args.reps, args.warmup, args.seed,
                                              args.tied))[0]
            peaks, bubbles = [g[0] for g in got], [round(g[1], 2) for g in got]
            torch_bubbles = [round(g[4], 2) for g in got]
            v = VIRTUAL if kind == "interleaved" else 1
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}_{kind}_m{m}.svg"), "w") as f:
                f.write(timeline_svg([g[2] for g in got]))
            med = {k: statistics.median(v) for k, v in times.items()}
            cmed = {k: statistics.median(v) for k, v in cpu.items()}
            lines.append(f"| {kind} | {m} | {med['gt replay'] * 1e3:.1f} | {med['gt'] * 1e3:.1f} | "
                         f"{med['torch.pipelining'] * 1e3:.1f} | {ratio(times, 'gt replay')} | {ratio(times, 'gt')} | "
                         f"{cmed['gt replay'] * 1e3:.1f} / {cmed['torch.pipelining'] * 1e3:.1f} = "
                         f"{ratio(cpu, 'gt replay')} | " + (f"{ratio(times, 'gt tied replay')} | " if args.tied else "") +
                         f"{(p - 1) / (v * m + p - 1):.2f} | {bubbles} | {torch_bubbles} | {peaks} | "
                         f"{[g[3] // 1024 for g in got]} |")
            data.append({"schedule": kind, "m": m, "times": times, "cpu": cpu, "peaks": peaks, "bubbles": bubbles,
                         "torch_bubbles": torch_bubbles,
                         "activation_bytes": [g[3] for g in got],
                         "timelines": [g[2] for g in got]})
    table = "\n".join(lines)
    print(table)
    write_results(args.out, name, table, data)


if __name__ == "__main__":
    main()
