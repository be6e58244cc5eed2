"""scaled_dot_product_attention's CPU kernels (+ backward): batch and heads split for free.

q, k, v are [batch, heads, seq, head_dim]; a mask broadcasts like a
pointwise operand of [batch, heads, q_seq, k_seq]. Splitting the query
sequence needs whole keys and values and no causal offset, so it is offered
only without `is_causal` and without dropout (whose draws depend on the shard).
"""
from __future__ import annotations

import torch

from .registry import B, Ctx, S, Rule, aten, pointwise_dims, register


def attention_signatures(backward: bool):
    def signatures(ctx: Ctx) -> list:
        off = 1 if backward else 0  # backward inputs: grad_out, q, k, v, out, logsumexp[, mask]
        q, k = ctx.shapes[off], ctx.shapes[off + 1]
        n_main = 6 if backward else 3
        has_mask = len(ctx.shapes) > n_main
        n_out = 3 if backward else 2
        dropout_p = ctx.arg(3 + (3 if backward else 0), "dropout_p", 0.0)
        causal = ctx.arg(4 + (3 if backward else 0), "is_causal", False)
        if dropout_p:
            return []  # dropout draws inside the kernel: only the replicated run matches one device
        full = tuple(q[:-1]) + (k[-2],)
        sigs = []
        for d in (0, 1):
            mask = (pointwise_dims(ctx.shapes[-1], full, d),) if has_mask else ()
            sigs.append(((S(d),) * n_main + mask, (S(d),) * n_out))
        if not backward and not causal:
            mask = (pointwise_dims(ctx.shapes[-1], full, 2),) if has_mask else ()
            sigs.append(((S(2), B, B) + mask, (S(2), S(2))))
        return sigs
    return signatures


def skip_empty(func, args, kwargs, where):
    """The CPU flash kernels divide by zero on an empty shard (uneven heads/batch): answer with zeros."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if all(t.numel() for t in tensors) or any(t.device.type == "meta" for t in tensors):
        return func(*args, **kwargs)
    meta = [torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a for a in args]
    mkw = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
           for k, v in kwargs.items()}
    return tuple(tensors[0].new_zeros(o.shape, dtype=o.dtype) for o in func(*meta, **mkw))


def _dropout_key(backward: bool):
    """The signatures read whether dropout is on (the decision cache keys on that, not on p)."""
    i = 3 + (3 if backward else 0)
    return lambda args, kwargs: bool(args[i] if len(args) > i else kwargs.get("dropout_p", 0.0))


register([aten._scaled_dot_product_flash_attention_for_cpu.default],
         Rule(attention_signatures(False), local=skip_empty, scalar_key=_dropout_key(False)))
register([aten._scaled_dot_product_flash_attention_for_cpu_backward.default],
         Rule(attention_signatures(True), local=skip_empty, scalar_key=_dropout_key(True)))
