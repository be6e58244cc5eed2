"""What a choice computes: floating-point operations on each rank's shards, for the time a decision weighs.

A choice that moves fewer bytes but leaves ranks idle (a batch of 2 split over 4 ranks, a matmul's rows
gathered onto half of them) is slower by the work the busy ranks do for the idle ones; the link model's
compute rate (`LinkModel.flop`, `runtime/topology.py`) prices it. The counts are torch's own
(`torch.utils.flop_counter`: matmuls, convolutions, fused attention), plus CPU flash attention's, which
torch's table lacks. Ops torch counts nothing for (pointwise, views, reductions) add no compute term: their
work follows their bytes, which the choice already pays for in what it moves.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils import flop_counter

aten = torch.ops.aten


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                            **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_OWN: dict = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
              aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward}


def formula(func: Any) -> Optional[Callable[..., int]]:
    """The FLOP count of `func` (an OpOverload) from its arguments and `out_val=`; None where none is known."""
    packet = getattr(func, "overloadpacket", func)
    return _OWN.get(packet) or flop_counter.flop_registry.get(packet)


def per_rank(func: Any, count: Callable[..., int], args: Any, kwargs: dict, in_shapes: list, out_shapes: list,
             flat_ranks: tuple, world: int, meta_like: Callable, map_tensors: Callable) -> tuple:
    """Per global rank (a vector of `world`), the FLOPs of `func` on its shards: `in_shapes[i][k]`, the i-th
    tensor argument's shard shape on the k-th rank of `flat_ranks`, likewise `out_shapes` for the outputs
    (None: no such output). Ranks whose shards are alike are counted once."""
    out = [0] * world
    seen: dict = {}
    for k, r in enumerate(flat_ranks):
        ins = tuple(s[k] for s in in_shapes)
        key = (ins, tuple(None if s is None else s[k] for s in out_shapes))
        got = seen.get(key)
        if got is None:
            largs, lkwargs = map_tensors(args, kwargs, lambda t, i: meta_like(t, ins[i]))
            outs = tuple(None if s is None else torch.empty(s[k], device="meta") for s in out_shapes)
            try:
                got = int(count(*largs, **lkwargs, out_val=outs[0] if len(outs) == 1 else outs))
            except Exception:  # a formula that cannot read these arguments: no compute term for the call
                return (0,) * world
            seen[key] = got
        out[r] = got
    return tuple(out)
