"""Dry run (gt.explain) of a 1-billion-parameter GPT's DP x TP training step: bytes per module, and the time.

    python bench/explain.py                  # 20 layers, n_embd 2048, vocab 50304, 1024 tokens: 1.1e9 parameters
    python bench/explain.py --mesh 4x2 --layers 20 --tree

Nothing is allocated: the model, the batch and every shard are meta tensors, and the simulator's
collectives pass shapes only, so the report is what one step would move on DATAxTENSOR real ranks.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

import globaltensor as gt
from globaltensor.tools.explain import explain
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan


def step(cfg: GPTConfig, mesh: tuple, batch: int) -> None:
    warnings.simplefilter("ignore")
    model = GPT(cfg)
    p = gt.placement("cpu", np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())
    gt.to_global(model, p, tp_plan(1, 2))
    idx = gt.to_global(torch.zeros(batch, cfg.block_size, dtype=torch.long), p, dp_batch(0, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(idx, idx)[1].backward()
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="4x2", help="data x tensor")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tree", action="store_true", help="print rank 0's whole report")
    a = ap.parse_args()
    mesh = tuple(int(v) for v in a.mesh.split("x"))
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=a.layers, n_head=16, n_embd=a.embd)
    with torch.device("meta"):
        n = sum(q.numel() for q in GPT(cfg).parameters())
    t = time.perf_counter()
    reports = explain(step, mesh[0] * mesh[1], args=(cfg, mesh, a.batch))
    took = time.perf_counter() - t
    rep = reports[0]
    print(f"GPT {n / 1e9:.2f}e9 parameters, {a.layers} layers, n_embd {a.embd}, batch {a.batch} x {cfg.block_size} "
          f"tokens, DP={mesh[0]} x TP={mesh[1]}: dry run in {took:.1f} s")
    by = {}
    for c in rep.collectives:
        key = (c.phase, c.kind, c.axis)
        by[key] = by.get(key, 0) + c.recv_bytes
    for (phase, kind, axis), b in sorted(by.items()):
        print(f"  {phase:<8} {kind:<14} mesh axis {axis}: {b / 2 ** 20:10.1f} MiB received by rank 0")
    print(f"  total {rep.recv_bytes / 2 ** 20:.1f} MiB in {len(rep.collectives)} collectives")
    if a.tree:
        print(rep.tree())


if __name__ == "__main__":
    main()
