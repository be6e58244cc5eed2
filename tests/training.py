"""The training loop the model tests share: AdamW steps, each step's loss, then the parameters."""
from __future__ import annotations

from typing import Optional

import torch


def adamw_steps(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor, steps: int, placed: bool,
                foreach: Optional[bool] = None) -> tuple[list, dict]:
    """(each step's loss, {name: parameter}) after `steps` AdamW steps (lr 1e-2) of `model(idx, tgt)[1]`.

    `placed`: the model is converted (GlobalTensors), so losses and parameters are read whole; the
    parameters come back on the CPU either way, to compare with a reference run."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    losses = []
    for _ in range(steps):
        _, loss = model(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.full_tensor().item() if placed else loss.item())
    params = {n: (p.full_tensor() if placed else p).detach().cpu() for n, p in model.named_parameters()}
    return losses, params
