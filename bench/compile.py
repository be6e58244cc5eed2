"""torch.compile on a GPT training step: eager globaltensor vs compiled globaltensor vs torch compiled alike.

    python bench/compile.py                     # DP, TP, ZeRO-3 on 2 gloo processes, aot_eager
    python bench/compile.py --inductor          # adds inductor (C++ kernels: minutes of compile per process)
    python bench/compile.py --quick             # a smoke run

One step = forward + backward + AdamW step (foreach) on `models/gpt.py`'s small GPT (the tests' size of
bench/zero.py), the same batches on every implementation. Compiled means the same two calls compiled on
both sides, the model's loss and `opt.step` (`_compiled`), no `fullgraph` (torch.optim breaks the graph
around its update itself; DDP splits its graph at its buckets; FSDP2's hooks are skipped by dynamo).

- DP: globaltensor with no plan (weights Broadcast, the batch split; the optimizer's first read
  all-reduces the gradients in one bucket) vs DDP.
- TP: globaltensor `tp_plan` vs DTensor `parallelize_module` (bench/train_step.py's recipe).
- ZeRO-3: globaltensor `zero_plan` vs FSDP2 `fully_shard` per block and at the root (bench/zero.py's).

Each step's wall time is the slowest rank's (interleaved, fresh random order per repetition, between
barriers: bench/common.py); its CPU time is the process's (`time.process_time`), max over ranks. The
first step of each implementation is untimed (it compiles).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import globaltensor as gt  # noqa: E402
from common import agree_on_failures, attempt, interleaved_times, paired_ratio_ci, write_results  # noqa: E402
from globaltensor.models.gpt import GPTConfig  # noqa: E402
from train_step import DTensorTrainer, GlobalTensorTrainer, batches  # noqa: E402
from zero import GlobalTensorZero, TorchData  # noqa: E402

STRATEGIES = ("DP", "TP", "ZeRO-3")


def _build(strategy: str, torch_side: bool, cfg: GPTConfig, n: int, lr: float, seed: int):
    if strategy == "DP":
        return TorchData(cfg, n, lr, seed, "DDP") if torch_side else GlobalTensorTrainer(cfg, n, 1, lr, seed)
    if strategy == "TP":
        return DTensorTrainer(cfg, 1, n, lr, seed) if torch_side else GlobalTensorTrainer(cfg, 1, n, lr, seed)
    return TorchData(cfg, n, lr, seed, "FSDP2") if torch_side else GlobalTensorZero(cfg, n, lr, seed, reshard=True)


def _compiled(trainer, backend: str):
    """The trainer's model call compiled as its loss (the logits it also returns are left out: AOTAutograd
    hands an output that takes no gradient a plain zero tangent, which neither a GlobalTensor nor a DTensor
    output accepts), and its optimizer's step."""
    model = trainer.model
    loss = torch.compile(lambda idx, tgt: model(idx, tgt)[1], backend=backend)
    trainer.model = lambda idx, tgt: (None, loss(idx, tgt))
    trainer.model.parameters = model.parameters  # (for what the trainers read back)
    trainer.opt.step = torch.compile(trainer.opt.step, backend=backend)
    return trainer


def impls(strategy: str, backends: list[str]) -> dict[str, tuple[bool, str | None]]:
    """name -> (torch's side, compile backend or None for eager)."""
    torch_name = {"DP": "DDP", "TP": "DTensor", "ZeRO-3": "FSDP2"}[strategy]
    out = {"gt eager": (False, None)}
    for b in backends:
        out[f"gt {b}"] = (False, b)
    out[f"{torch_name} eager"] = (True, None)
    for b in backends:
        out[f"{torch_name} {b}"] = (True, b)
    return out


def timed(strategy: str, backends: list[str], cfg: GPTConfig, batch: int, reps: int, warmup: int, lr: float,
          seed: int):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    n = dist.get_world_size()
    data = batches(cfg, batch, reps + warmup + 2)
    errors: dict[str, str] = {}
    built = {}
    for name, (torch_side, backend) in impls(strategy, backends).items():
        t = attempt(errors, name, _build, strategy, torch_side, cfg, n, lr, seed)
        if t is not None and backend is not None:
            t = attempt(errors, name, _compiled, t, backend)
        built[name] = t
    errors = agree_on_failures(errors)
    compile_s = {}
    for k, impl in built.items():
        if k not in errors:
            t0 = time.perf_counter()
            attempt(errors, k, impl.step, *data[0])
            compile_s[k] = time.perf_counter() - t0
    errors = agree_on_failures(errors)
    live = {k: v for k, v in built.items() if k not in errors}
    cpu: dict[str, list[float]] = {k: [] for k in live}
    nxt = {k: 1 for k in live}

    def stepper(k: str):
        def fn() -> None:
            c0 = time.process_time()
            live[k].step(*data[nxt[k]])
            cpu[k].append(time.process_time() - c0)
            nxt[k] += 1
        return fn
    times = interleaved_times({k: stepper(k) for k in live}, reps, warmup)
    gathered: list = [None] * n
    dist.all_gather_object(gathered, (cpu, compile_s))
    cpu_max = {k: [max(g[0][k][warmup + i] for g in gathered) for i in range(reps)] for k in live}
    losses = {k: [round(x, 5) for x in v.loss_values()[:3]] for k, v in live.items()}
    return {"times": times, "cpu": cpu_max, "errors": errors, "losses": losses,
            "compile_s": {k: max(g[1].get(k, 0.0) for g in gathered) for k in live}}


def report(results: dict, args) -> str:
    lines = [f"torch {torch.__version__}, {args.ranks} gloo processes, 1 thread each, small GPT "
             f"(vocab 256, block 64, 2 layers, 4 heads, 128 wide), batch {args.batch}, {args.reps} repetitions",
             "", "| strategy | implementation | step wall ms (median) | step CPU ms per rank (median) | "
             "wall vs gt eager (~95% interval) | CPU vs gt eager | first step s (compile) |",
             "|---|---|---|---|---|---|---|"]
    for strategy, res in results.items():
        times, cpu = res["times"], res["cpu"]
        for k in times:
            lo, hi = paired_ratio_ci(times, k, "gt eager") if "gt eager" in times else (float("nan"),) * 2
            clo, chi = paired_ratio_ci(cpu, k, "gt eager") if "gt eager" in cpu else (float("nan"),) * 2
            r = statistics.median(a / b for a, b in zip(times[k], times["gt eager"]))
            c = statistics.median(a / b for a, b in zip(cpu[k], cpu["gt eager"]))
            lines.append(f"| {strategy} | {k} | {1e3 * statistics.median(times[k]):.1f} | "
                         f"{1e3 * statistics.median(cpu[k]):.1f} | {r:.2f} ({lo:.2f}-{hi:.2f}) | "
                         f"{c:.2f} ({clo:.2f}-{chi:.2f}) | {res['compile_s'][k]:.1f} |")
        for k, why in res["errors"].items():
            lines.append(f"| {strategy} | {k} | failed: {why[:100]} | | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=STRATEGIES, default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    if args.quick:
        cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
        args.reps, args.warmup, args.batch = 3, 1, 4
    backends = ["aot_eager"] + (["inductor"] if args.inductor else [])
    results = {}
    for strategy in ([args.only] if args.only else STRATEGIES):
        results[strategy] = gt.launch(timed, args.ranks, backend="gloo", timeout=3600,
                                      args=(strategy, backends, cfg, args.batch, args.reps, args.warmup, args.lr,
                                            args.seed))[0]
        print(strategy, results[strategy]["losses"], results[strategy]["errors"], flush=True)
    table = report(results, args)
    print(table)
    write_results(args.out, "compile" + ("_quick" if args.quick else ""), table, results)


if __name__ == "__main__":
    main()
