"""scaled_dot_product_attention's CPU kernels (+ backward): batch and heads split for free.

q, k, v are [batch, heads, seq, head_dim]; a mask broadcasts like a
pointwise operand of [batch, heads, q_seq, k_seq]. Splitting the query
sequence needs whole keys and values and no causal offset, so it is offered
only without `is_causal` and without dropout (whose draws depend on the shard).
"""
from __future__ import annotations

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


register([aten._scaled_dot_product_flash_attention_for_cpu.default], Rule(attention_signatures(False)))
register([aten._scaled_dot_product_flash_attention_for_cpu_backward.default], Rule(attention_signatures(True)))
