"""Per-step communication of DP x TP GPT training against what Megatron-style TP + DP must move.

Counted analytically from the model's dims (fp32, per rank, tensor degree t,
data degree d, N tokens per data rank, hidden h), with `tp_plan`'s layouts
(weights never move; the residual stream stays Broadcast on the tensor axis):
forward all-reduces the vocab-parallel embedding output and the two
row-parallel outputs per layer (attention and MLP `proj`); backward
all-reduces the input gradients of the column-parallel regions (q/k/v once,
fc, the head); the data axis all-reduces every gradient shard once in the
step, all of them in one flat bucket (one collective, as DDP); the optimizer
moves nothing more.

The loss is the model's unchanged `F.cross_entropy` (log_softmax + nll_loss)
over vocab-split logits: two [N] all-reduces forward (row max, row sum of
exp) and one backward (the row sum of the log_softmax gradient), where
Megatron's fused kernel does three forward (max, sum of exp, target logit)
and none backward: the same bytes, in other phases; the loss itself stays
Partial on the tensor axis. A mean over a batch split all-reduces the count
of scored targets (one scalar on the data axis), as Megatron-Core's
per-token loss all-reduces its token count.
"""
from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=16)
BATCH = 8
F32 = 4


def _all_reduce_bytes(numel: int, n: int) -> int:
    return 2 * (n - 1) * numel * F32 // n if n > 1 else 0


def megatron(mesh: tuple, params: list) -> dict:
    """{(phase, kind, mesh axis): (count, bytes received by one rank)}; params: (global shape, tp-split?)."""
    d, t = mesh
    n_tok, h, out = BATCH // d * CFG.block_size, CFG.n_embd, Counter()

    def ar(phase, axis, numel, deg):
        if deg > 1:
            out[(phase, "all_reduce", axis, "n")] += 1
            out[(phase, "all_reduce", axis, "b")] += _all_reduce_bytes(numel, deg)
    ar("forward", 1, n_tok * h, t)                         # vocab-parallel embedding
    for _ in range(CFG.n_layer):
        ar("forward", 1, n_tok * h, t)                     # attention proj (row-parallel)
        ar("forward", 1, n_tok * h, t)                     # MLP proj (row-parallel)
        ar("backward", 1, n_tok * h, t)                    # grad of the q/k/v input
        ar("backward", 1, n_tok * h, t)                    # grad of the fc input
    ar("forward", 1, n_tok, t)                             # log_softmax over split vocab: row max
    ar("forward", 1, n_tok, t)                             #   row sum of exp
    ar("backward", 1, n_tok, t)                            #   backward: row sum of the gradient
    ar("forward", 0, 1, d)                                 # mean over the split batch: target count
    ar("backward", 1, n_tok * h, t)                        # grad of the head's input
    if d > 1:                                              # data-parallel gradient reduction: one
        out[("step", "all_reduce", 0, "n")] += 1           # flat bucket (as DDP's), the bytes of
        for shape, split in params:                        # reducing each gradient shard once
            out[("step", "all_reduce", 0, "b")] += _all_reduce_bytes(int(np.prod(shape)) // (t if split else 1), d)
    return {k: v for k, v in out.items() if v}


def _measure(mesh):
    torch.manual_seed(0)
    model = GPT(CFG)
    p = gt.placement("cpu", np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())
    gt.to_global(model, p, tp_plan(1, 2))
    g = torch.Generator().manual_seed(1)
    idx, tgt = (gt.to_global(torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g), p,
                             dp_batch(0, 2)) for _ in range(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = Counter()
    axis_of = {tuple(grp): a for a in range(2) for grp in p.axis_groups(a)}

    def record(phase, log):
        for e in log.events:
            got[(phase, e.kind, axis_of[e.group], "n")] += 1
            got[(phase, e.kind, axis_of[e.group], "b")] += e.recv_bytes
    with gt.comm_log() as log:
        loss = model(idx, tgt)[1]
    record("forward", log)
    with gt.comm_log() as log:
        loss.backward()
    record("backward", log)
    with gt.comm_log() as log:
        opt.step()
    record("step", log)
    params = [(tuple(q.shape), q.sbp[1] != gt.broadcast) for q in model.parameters()]
    return dict(got), params


@pytest.mark.parametrize("mesh", [(2, 1), (1, 2), (2, 2)])
def test_step_communication_equals_megatron(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(_measure, mesh[0] * mesh[1], args=(mesh,))
    for got, params in results:
        assert got == megatron(mesh, params)
