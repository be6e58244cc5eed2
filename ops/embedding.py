"""Embedding (+ dense backward): split tokens, split features, or a vocab-split table.

A vocab-split (S(0)) table gives a P output: each rank looks up the rows it
holds and zeroes the tokens it does not (Megatron's vocab-parallel
embedding); the backward writes only the rows a rank holds. With the whole
gradient and the whole indices, the backward's output is Broadcast (a
Broadcast table's gradient must not be gathered later; a vocab-split table
takes its rows from it locally), so a vocab-split table builds the whole
table's gradient transiently.
"""
from __future__ import annotations

from .registry import B, Ctx, ShardSite, P, Rule, S, aten, register


def _vocab_mask(indices, start: int, size: int):
    outside = (indices < start) | (indices >= start + size)
    return outside, (indices - start).masked_fill(outside, 0)


def embedding_signatures(ctx: Ctx) -> list:
    n_idx = len(ctx.shapes[1])
    sigs = [((B, S(d)), (S(d),)) for d in range(n_idx)]
    sigs += [((S(1), B), (S(n_idx),)), ((S(0), B), (P,)), ((P, B), (P,))]
    return sigs


def embedding_local(func, args, kwargs, where: ShardSite):
    weight, indices = args[0], args[1]
    start, size = where.in_box(0)[0]
    if size == where.ctx.shapes[0][0]:
        return func(*args, **kwargs)
    outside, local_idx = _vocab_mask(indices, start, size)
    if size == 0:
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    out = func(weight, local_idx, *args[2:], **kwargs)
    return out.masked_fill(outside.unsqueeze(-1), 0)


def embedding_backward_signatures(ctx: Ctx) -> list:
    n_idx = len(ctx.shapes[1])
    sigs = [((S(d), S(d)), (P,)) for d in range(n_idx)]
    sigs += [((S(n_idx), B), (S(1),)), ((P, B), (P,)), ((B, B), (B,))]
    if not ctx.arg(4, "scale_grad_by_freq", False):
        sigs.append(((B, B), (S(0),)))
    return sigs


def embedding_backward_local(func, args, kwargs, where: ShardSite):
    grad, indices, num_weights, padding_idx = args[0], args[1], args[2], args[3]
    start, size = where.out_box(0)[0]
    if size == num_weights:
        return func(*args, **kwargs)
    outside, local_idx = _vocab_mask(indices, start, size)
    grad = grad.masked_fill(outside.unsqueeze(-1), 0)
    pad = padding_idx - start if start <= padding_idx < start + size else -1
    return func(grad, local_idx, size, pad, *args[4:], **kwargs)


register([aten.embedding.default], Rule(embedding_signatures, kernel=embedding_local))
register([aten.embedding_dense_backward.default],
         Rule(embedding_backward_signatures, kernel=embedding_backward_local))
