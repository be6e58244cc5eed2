"""Sorting and selection along one dim (topk, sort, kthvalue, median, mode, cummax/cummin).

Each works along `dim` and is independent across the other dims: a split of
any other dim passes to both outputs (values and indices), and the indices
stay local to `dim`, which is whole on every rank. A split `dim` is taken
whole (the data-dependent choice needs all of it). Their backward is a
`new_zeros` and a `scatter` along `dim` (ops/indexing.py), split the same way.
"""
from __future__ import annotations

from .registry import Ctx, Rule, S, overloads, register


def along_dim_signatures(ctx: Ctx) -> list:
    n = len(ctx.shapes[0])
    dim = ctx.named("dim", -1) % max(n, 1)
    n_out = len(ctx.out_shapes)
    return [((S(d),), (S(d),) * n_out) for d in range(n) if d != dim]


SELECTIONS = [op for packet in overloads("topk", "sort", "kthvalue", "median", "nanmedian", "mode", "cummax",
                                         "cummin")
              for op in (getattr(packet, o) for o in packet.overloads())
              if any(a.name == "dim" for a in op._schema.arguments) and not op._schema.arguments[-1].is_out
              and "out" not in op._overloadname and "dimname" not in op._overloadname]
register(SELECTIONS, Rule(along_dim_signatures))
