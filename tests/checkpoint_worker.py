"""A training run that checkpoints every step and can resume: the body of the kill-and-resume test.

    python tests/checkpoint_worker.py DIR STEPS [--backend sim|gloo] [--ranks 2] [--resume] [--dtype float32]

Each step prints `step N loss <hex>` (rank 0), then `saved N` once the checkpoint of step N
is complete; at the end `params <sha256 of every full parameter's bytes>`. The model is the
GPT with dropout (the RNG must continue exactly), TP over the ranks, AdamW.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import warnings

import torch

import globaltensor as gt
from globaltensor import checkpoint as gtc
from globaltensor.models.gpt import GPT, GPTConfig, tp_plan


def _say(line: str) -> None:
    if gt.rank() == 0:
        print(line, flush=True)


def train(root: str, steps: int, resume: bool, dtype: str) -> tuple[dict[int, str], str]:
    """Returns the losses of the steps this run took ({step: float.hex()}) and the parameters' digest."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
    model = GPT(cfg).to(getattr(torch, dtype))
    p = gt.placement("cpu", list(range(gt.world_size())))
    gt.to_global(model, p, tp_plan(tensor_axis=0, ndim=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = gtc.load_training(gtc.latest(root), model, opt) if resume else 0
    losses = {}
    for step in range(start, steps):
        data = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=torch.Generator().manual_seed(step))
        _, loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.full_tensor().item().hex()
        _say(f"step {step} loss {losses[step]}")
        gtc.save_training(os.path.join(root, f"step-{step + 1:06d}"), model, opt, step + 1)
        _say(f"saved {step + 1}")
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode() + t.full_tensor().contiguous().numpy().tobytes())
    _say(f"params {digest.hexdigest()}")
    return losses, digest.hexdigest()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("steps", type=int)
    ap.add_argument("--backend", default="sim")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    gt.launch(train, a.ranks, backend=a.backend, args=(a.root, a.steps, a.resume, a.dtype))
    sys.stdout.flush()
