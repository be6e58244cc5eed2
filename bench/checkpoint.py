"""Checkpoint size and save/load time: globaltensor vs the same GPT under torch DTensor, through DCP.

    python bench/checkpoint.py             # DP=2 x TP=2 on 4 gloo processes
    python bench/checkpoint.py --quick     # a smoke run
    python bench/checkpoint.py --async-step   # a training step with an asynchronous save every step vs none

Both sides are bench/train_step.py's trainers (the same GPT, seed, plans: Megatron TP on the
tensor axis, vocab-parallel tied embedding, replicated over the data axis), trained one step so
that AdamW's state exists. Each side saves `{"model": ..., "optim": ...}` from torch's
`get_state_dict` with plain `dcp.save(checkpoint_id=...)` into a fresh directory, and loads it
back into its own live state dict with `dcp.load`: DCP's default planner, writer and reader on
both sides, so what differs is how each tensor type describes its chunks (globaltensor picks
the writing replica locally; DTensor lists every replica and DCP's global plan drops the extra
ones). Save and load are timed interleaved, in a fresh random order each repetition, between
barriers, the slowest rank's time (bench/common.py); ratios are medians of per-repetition
ratios with ~95% intervals. Files go to /dev/shm by default (`--dir` for a disk), so the
numbers are DCP's and the tensor types' work rather than the disk's.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import globaltensor as gt
from common import interleaved_times, paired_ratio, paired_ratio_ci, write_results
from globaltensor.models.gpt import GPTConfig
from train_step import BUILDERS, batches

IMPLS = ("globaltensor", "DTensor")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _chunk_stats(md) -> tuple[int, int]:
    """(chunks, elements) the metadata lists for tensors: elements == the state's numel when each is written once."""
    chunks = elements = 0
    for v in md.state_dict_metadata.values():
        for c in getattr(v, "chunks", ()):
            chunks += 1
            elements += math.prod(c.sizes)
    return chunks, elements


def run(cfg: GPTConfig, dp: int, tp: int, reps: int, warmup: int, root: str, threads: int) -> dict:
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    trainers = {k: BUILDERS[k](cfg, dp, tp, 1e-3, 0) for k in IMPLS}
    (idx, tgt), = batches(cfg, 8, 1)
    states = {}
    for k, t in trainers.items():
        t.step(idx, tgt)
        msd, osd = get_state_dict(t.model, t.opt)
        states[k] = {"model": msd, "optim": osd}
    counter = {k: 0 for k in IMPLS}

    def saver(k):
        def fn():
            counter[k] += 1
            if dist.get_rank() == 0 and counter[k] > 2:  # keep the tmpfs small: drop the one before last
                shutil.rmtree(os.path.join(root, k, str(counter[k] - 2)), ignore_errors=True)
            dcp.save(states[k], checkpoint_id=os.path.join(root, k, str(counter[k])))
        return fn

    def loader(k):
        def fn():
            dcp.load(states[k], checkpoint_id=os.path.join(root, f"{k}-fixed"))
        return fn

    metas = {k: dcp.save(states[k], checkpoint_id=os.path.join(root, f"{k}-fixed")) for k in IMPLS}
    times = interleaved_times({**{f"save {k}": saver(k) for k in IMPLS}, **{f"load {k}": loader(k) for k in IMPLS}},
                              reps, warmup)
    out = {"median_s": {k: statistics.median(v) for k, v in times.items()}}
    for op in ("save", "load"):
        a, b = f"{op} globaltensor", f"{op} DTensor"
        out[f"{op} ratio"] = (paired_ratio(times, a, b), paired_ratio_ci(times, a, b))
    dist.barrier()
    out["bytes"] = {k: _dir_bytes(os.path.join(root, f"{k}-fixed")) for k in IMPLS}
    out["chunks"] = {k: _chunk_stats(metas[k]) for k in IMPLS}
    out["files"] = {k: len(os.listdir(os.path.join(root, f"{k}-fixed"))) for k in IMPLS}
    numel = 0
    for t in trainers["globaltensor"].opt.state.values():
        numel += sum(v.numel() for v in t.values() if torch.is_tensor(v))
    out["state_numel"] = numel + sum(p.numel() for p in trainers["globaltensor"].model.state_dict().values())
    return out


def run_async(cfg: GPTConfig, dp: int, tp: int, reps: int, warmup: int, root: str, threads: int) -> dict:
    """A training step alone, and the same step followed by an asynchronous save of the training state
    (`gt.checkpoint.save_training(..., async_save=True)`, DCP's `async_save`), waiting for the previous save
    before starting the next, as a loop that saves every step does: what the save costs the step."""
    import globaltensor.checkpoint as gtc
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    trainer = BUILDERS["globaltensor"](cfg, dp, tp, 1e-3, 0)
    (idx, tgt), = batches(cfg, 8, 1)
    trainer.step(idx, tgt)
    pending: list = []
    count = [0]

    def saving() -> None:
        trainer.step(idx, tgt)
        if pending:
            pending.pop().result()
        count[0] += 1
        if dist.get_rank() == 0 and count[0] > 2:  # keep the tmpfs small: drop the one before last
            shutil.rmtree(os.path.join(root, str(count[0] - 2)), ignore_errors=True)
        pending.append(gtc.save_training(os.path.join(root, str(count[0])), trainer.model, trainer.opt, count[0],
                                         async_save=True))

    times = interleaved_times({"step": lambda: trainer.step(idx, tgt), "step + async save": saving}, reps, warmup)
    if pending:
        pending.pop().result()
    return {"median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": (paired_ratio(times, "step + async save", "step"),
                      paired_ratio_ci(times, "step + async save", "step"))}


def report_async(r: dict, cfg: GPTConfig, args) -> str:
    med, (ratio, (lo, hi)) = r["median_s"], r["ratio"]
    return "\n".join([
        f"Training step with an asynchronous DCP save every step, GPT (n_layer {cfg.n_layer}, n_embd {cfg.n_embd}, "
        f"vocab {cfg.vocab_size}) + AdamW, DP=2 x TP=2 on 4 gloo processes, files on {args.dir or '/dev/shm'}; "
        f"{platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}; medians of {args.reps} interleaved "
        f"repetitions after {args.warmup} warm-up", "",
        "| step | step + async save | ratio (95% interval) |", "|---|---|---|",
        f"| {med['step'] * 1e3:.1f} ms | {med['step + async save'] * 1e3:.1f} ms | {ratio:.2f} ({lo:.2f}-{hi:.2f}) |"])


def report(r: dict, cfg: GPTConfig, args) -> str:
    med = r["median_s"]
    head = (f"DCP checkpoint of GPT (n_layer {cfg.n_layer}, n_embd {cfg.n_embd}, vocab {cfg.vocab_size}) + AdamW "
            f"state, DP=2 x TP=2 on 4 gloo processes, files on {args.dir or '/dev/shm'}; "
            f"{platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}; "
            f"medians of {args.reps} interleaved repetitions after {args.warmup} warm-up")
    lines = [head, "", "| | globaltensor | DTensor | gt / DTensor (95% interval) |", "|---|---|---|---|"]
    for op in ("save", "load"):
        ratio, (lo, hi) = r[f"{op} ratio"]
        lines.append(f"| {op} ms | {med[f'{op} globaltensor'] * 1e3:.1f} | {med[f'{op} DTensor'] * 1e3:.1f} | "
                     f"{ratio:.2f} ({lo:.2f}-{hi:.2f}) |")
    b = r["bytes"]
    lines.append(f"| checkpoint bytes | {b['globaltensor']} | {b['DTensor']} | {b['globaltensor'] / b['DTensor']:.3f} |")
    c = r["chunks"]
    lines.append(f"| chunks / elements in metadata | {c['globaltensor'][0]} / {c['globaltensor'][1]} | "
                 f"{c['DTensor'][0]} / {c['DTensor'][1]} | |")
    lines.append(f"| files | {r['files']['globaltensor']} | {r['files']['DTensor']} | |")
    lines += ["", f"Elements of the state (model state dict + AdamW tensors, global): {r['state_numel']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a folder in /dev/shm)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--async-step", action="store_true", help="time a step with an async save every step vs none")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        args.reps, args.warmup, args.n_embd, args.block, args.vocab = 3, 1, 32, 16, 64
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(prefix="gt-ckpt-bench-", dir=base)
    fn, show, stem = (run_async, report_async, "checkpoint_async") if args.async_step else (run, report, "checkpoint")
    try:
        result = gt.launch(fn, 4, backend="gloo", args=(cfg, 2, 2, args.reps, args.warmup, root, args.threads))[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = show(result, cfg, args)
    print(text)
    if not args.quick:
        write_results(args.out, stem, text, {"config": vars(cfg), "args": vars(args), "result": result})
