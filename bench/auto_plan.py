"""`gt.auto_plan`'s planning time for an 8B-shaped GPT on meta (issue 38: <= 10 s for 64 ranks), and the GPT's auto
plan beside the hand plans of its family (predicted bytes, time, peak memory per rank and step).

    .venv/bin/python bench/auto_plan.py [--meshes 2x4,8x8] [--all-ranks]

`--all-ranks`: every dry run on every rank (no symmetric runs), the way it was planned before.
Results: bench/RESULTS.md ("auto_plan")."""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, tp_plan
from globaltensor.runtime import symmetry


def eight_b() -> tuple:
    """Width 4,096, 32 layers, 32 heads, vocab 128,256, 8 x 2,048 tokens, on meta."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128256, block_size=2048, n_layer=32, n_head=32, n_embd=4096))
    idx = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    return model, (idx, idx)


def mesh_of(shape: tuple) -> gt.Placement:
    return gt.placement("cpu", np.arange(math.prod(shape)).reshape(shape).tolist())


def row(c, name: str) -> str:
    f = c.figures
    return (f"| {name} | {max(f.recv_bytes):,} | {max(f.collectives)} | {c.time * 1e3:.1f} | "
            f"{c.peak_memory / 2 ** 30:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--meshes", default="2x4,8x8")
    ap.add_argument("--all-ranks", action="store_true")
    args = ap.parse_args()
    runs = {"symmetric": 0, "all ranks": 0}
    real = symmetry.run

    def counted(body, mesh):
        try:
            out = real(body, mesh)
        except symmetry.Asymmetric:
            runs["all ranks"] += 1
            raise
        runs["symmetric"] += 1
        return out

    def refused(body, mesh):
        runs["all ranks"] += 1
        raise symmetry.Asymmetric("--all-ranks")
    symmetry.run = refused if args.all_ranks else counted
    model, inputs = eight_b()
    for spec in args.meshes.split(","):
        shape = tuple(int(x) for x in spec.split("x"))
        runs.update({"symmetric": 0, "all ranks": 0})
        t, cpu = time.perf_counter(), time.process_time()
        auto = gt.auto_plan(model, inputs, mesh_of(shape), tensor_plans={"tp": tp_plan})
        total, cpu = time.perf_counter() - t, time.process_time() - cpu
        print(f"8B-shaped GPT on {spec} ({math.prod(shape)} ranks): {total:.1f} s in all ({cpu:.1f} CPU-s): dry runs "
              f"{auto.measure_seconds:.1f} s ({runs['symmetric']} symmetric, {runs['all ranks']} on every rank), "
              f"solve {auto.solve_seconds:.2f} s, {len(auto.candidates):,} candidates")
        print("| plan | recv B (max rank) | collectives | predicted ms | peak GiB |\n|---|---:|---:|---:|---:|")
        print(row(auto.chosen, "auto: " + gt.planning.describe(auto.chosen, auto.blocks)))
        for c in auto.candidates:
            uniform = [s for s, k in c.blocks if k]
            if uniform == [c.root]:
                print(row(c, f"hand: axes {c.axes}, {c.root}"))
        print()


if __name__ == "__main__":
    main()
