"""Embedding bag (+ backwards): the feature dim split (a table split on its columns, as tensor parallelism
lays out a wide embedding), and Partial through the table where the bag is a sum or a mean.

Each output column is the same reduction of the same table column over each bag, so a table S(1) gives
the output S(1) with the indices whole; the bags' bookkeeping (offset2bag, bag_size) depends only on the
indices and is the same on every rank (Broadcast), and the max mode's argmax per column splits with the
columns. The gradient of the table is split alike; the per-sample weights' gradient is a sum over the
columns, so each rank's columns give a share of it: Partial.
"""
from __future__ import annotations

from .registry import B, Ctx, P, Rule, S, overloads, register


def _mode(ctx: Ctx) -> int:
    return int(ctx.named("mode", 0))


def bag_signatures(ctx: Ctx) -> list:
    """(weight, indices, offsets, [per_sample_weights]) -> (out, offset2bag, bag_size, max_indices)."""
    extra = (B,) * (len(ctx.shapes) - 3)
    max_idx = ctx.out_shapes[3]
    sigs = [((S(1), B, B) + extra, (S(1), B, B, S(1) if max_idx is not None and len(max_idx) == 2 else B))]
    if _mode(ctx) in (0, 1):  # a sum or a mean of rows: linear in the table
        sigs.append(((P, B, B) + extra, (P, B, B, B)))
    return sigs


def bag_backward_signatures(ctx: Ctx) -> list:
    """(grad, indices, offsets?, offset2bag, bag_size, maximum_indices, [per_sample_weights]) -> table grad."""
    if ctx.named("sparse", False):
        return []
    dense = "dense" in ctx.func._schema.name
    n_fixed = 5 if dense else 6
    max_idx = ctx.shapes[n_fixed - 1]
    extra = (B,) * (len(ctx.shapes) - n_fixed)
    mid = (B,) * (n_fixed - 2)
    return [((S(1),) + mid + (S(1) if len(max_idx) == 2 else B,) + extra, (S(1),)),
            ((P,) + mid + (B,) + extra, (P,))]


def per_sample_weights_backward_signatures(ctx: Ctx) -> list:
    """(grad, weight, indices, offsets, offset2bag) -> [indices]: a sum over the columns."""
    return [((S(1), S(1), B, B, B), (P,)), ((P, B, B, B, B), (P,))]


def _no_out(op) -> list:
    return [getattr(op, o) for o in op.overloads() if "out" not in o]


for _packet in overloads("_embedding_bag", "_embedding_bag_forward_only"):
    register(_no_out(_packet), Rule(bag_signatures))
for _packet in overloads("_embedding_bag_backward", "_embedding_bag_dense_backward"):
    register(_no_out(_packet), Rule(bag_backward_signatures))
for _packet in overloads("_embedding_bag_per_sample_weights_backward"):
    register(_no_out(_packet), Rule(per_sample_weights_backward_signatures))
