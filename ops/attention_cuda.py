"""scaled_dot_product_attention's CUDA kernels (flash, memory-efficient, cuDNN; + backward): batch and
heads split for free.

On a GPU torch's composite `scaled_dot_product_attention` picks its kernel from the GlobalTensor's
own metadata (global shape, dtype, device), before any rank looks at its shard, so every rank takes
the same kernel: flash for half precision, memory-efficient for fp32, the math decomposition for fp64
(whose ops have their own rules). Without these rules each fused call fell back and gathered q, k, v
(found on the first GPU run: a ZeRO-3 GPT step on cuda placements moved three activation gathers per
block more than on cpu).

Each kernel works on [batch, heads, seq, head_dim] and its per-row log-sum-exp [batch, heads, seq(,
padded)]; a batch or heads split runs it on the shards as one device would on those rows. A sequence
split is converted by the planner into a heads or batch split (Ulysses' all-to-all) or gathered: the
CPU rules' ring (`ops/ring_attention.py`) drives the CPU kernel's math and is not written for these.
Their random state (philox seed and offset) and the varlen bookkeeping (cumulative lengths, max
lengths) are the same on every rank where dropout is off; with dropout the kernel draws per call from
the device generator, and a split draw is not one device's, so dropout runs replicated (one device's
mask, as the CPU path's decomposition does).
"""
from __future__ import annotations

from typing import Any

import torch

from .registry import B, Ctx, ShardSite, S, Rule, overloads, pointwise_dims, register

# arguments and returns that hold no rows: random state and varlen bookkeeping
_AUX = {"philox_seed", "philox_offset", "rng_state", "unused", "cum_seq_q", "cum_seq_k"}
_LSE = {"logsumexp", "log_sumexp"}


def _tensor_names(ctx: Ctx) -> list:
    """The schema's name of each tensor argument present in this call, in the dispatcher's order."""
    names = []
    for i, a in enumerate(ctx.func._schema.arguments):
        v = ctx.arg(i, a.name)
        if isinstance(v, torch.Tensor):
            names.append(a.name)
    return names


def _sbp(name: str, shape: tuple, full: tuple, d: int):
    if name in _AUX or len(shape) < 3:
        return B
    if name in _LSE or len(shape) == 3:
        return S(d)
    return pointwise_dims(shape, full, d)  # a mask or bias broadcast to [batch, heads, q_seq, k_seq]


def _signatures(ctx: Ctx) -> list:
    if ctx.named("dropout_p", 0.0):
        return []
    names = _tensor_names(ctx)
    q, k, v = (ctx.shapes[names.index(n)] for n in ("query", "key", "value"))
    full = tuple(q[:-1]) + (k[-2],)
    returns = [r.name for r in ctx.func._schema.returns if r.type.kind() == "TensorType"]
    sigs = []
    for d in (0, 1):
        if d == 1 and not q[1] == k[1] == v[1]:
            continue  # grouped heads: the composite repeats them before these kernels on every path it takes
        ins = tuple(_sbp(n, s, full, d) for n, s in zip(names, ctx.shapes))
        outs = tuple(B if s is None else _out_sbp(r, s, q, full, d) for r, s in zip(returns, ctx.out_shapes))
        sigs.append((ins, outs))
    return sigs


def _out_sbp(name: str, shape: tuple, q: tuple, full: tuple, d: int):
    """Outputs: the attention output and gradients split like q, the log-sum-exp per row, a debug mask
    (when asked for) like the scores, everything else whole."""
    if name in _AUX or len(shape) < 3 or tuple(shape[:2]) != tuple(q[:2]):
        return B
    return S(d) if len(shape) == 3 else pointwise_dims(shape, full, d)


def _local_for(op: Any):
    """The kernel on this rank's rows; on a shard with no rows (an uneven batch or heads split) the
    outputs' shapes from the meta kernel, zero-filled: a CUDA kernel is not asked to launch on nothing.
    Whether q is the first tensor or follows the incoming gradient (a backward) is the op's schema."""
    at = 1 if op._schema.arguments[0].name.startswith("grad") else 0

    def local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
        q = [a for a in args if isinstance(a, torch.Tensor)][at]
        if q.numel() or q.device.type == "meta":
            return func(*args, **kwargs)
        to_meta = lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
        out = func(*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()})
        return type(out)(torch.zeros(o.shape, dtype=o.dtype, device=q.device) if isinstance(o, torch.Tensor) else o
                         for o in out)
    return local


def _dropout_key(op: Any):
    """What the signatures read of the op's floats: whether dropout is on (the decision cache keys on it)."""
    at = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dropout_p")
    return lambda args, kwargs: bool(args[at] if len(args) > at else kwargs.get("dropout_p", 0.0))


def _no_dropout(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    """The hook is the kernel itself on a shard with rows; with dropout off no rank's draw differs (`Rule.plain_when`:
    a plain region excludes empty shards itself)."""
    return not ctx.named("dropout_p", 0.0)


for _packet in overloads("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                         "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"):
    register([_packet.default], Rule(_signatures, kernel=_local_for(_packet.default), scalar_key=_dropout_key(_packet.default),
                                     plain_when=_no_dropout))
