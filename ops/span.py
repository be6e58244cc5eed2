"""Where an op runs when its inputs live on different placements.

Operators never move a tensor across placements for you: a stage boundary is a plan's
decision (`gt.Layout` entries, `x.to_global`), because moving an activation or a weight is
the cost that placement exists to control. Scalars (0-dim GlobalTensors) are the exception,
as Python numbers and plain tensors already are: moving one costs a few bytes, and a program
written for one device combines them freely across what are, once pipelined, different stages:
`clip_grad_norm_` stacks one norm per parameter (each on its parameter's stage) and scales every
gradient by one coefficient; a MoE model stacks one auxiliary loss per layer. So:

- the op runs where its non-scalar inputs live (and an in-place op where its target lives: its
  result keeps the target's layout); a scalar from elsewhere must be Broadcast on ranks that
  include them, so that every rank computing holds it already, and is used as held, moving
  nothing (`clip_grad_norm_`'s coefficient, on the union of the stages, scaling each stage's
  gradients). A scalar on other ranks is an error naming the fix: a rank outside an op computes
  nothing and joins no collective (`ops/program.py`), so it could not send its scalar;
- an op on scalars only runs on the union of their placements (ranks in order, a 1-D mesh), each
  boxed there as any input (every rank holding one is inside): the result is known on every rank
  of every stage, as Megatron all-reduces the pipeline stages' norms so that each rank scales its
  own gradients by the same total;
- non-scalar inputs on several placements remain an error naming the fix.

The alternative, a `clip_grad_norm_` of our own (torchtitan's, which all-reduces the stages'
squared norms over the pipeline group), would need every user to call it. Megatron's bytes (one
scalar per stage) would need the op that stacks the norms to know that its consumer only sums
their squares; here each rank receives the other stages' norms, one scalar per parameter (2-stage
GPT of 36 parameters, `tests/test_pipeline.py`: 144 bytes per rank with stages of two ranks, 288
where the boxing zero-fills and all-reduces them in one collective), bytes that are noise beside
the gradients themselves and one collective's latency where they are packed.
"""
from __future__ import annotations

from typing import Any

from ..placement import Placement
from .registry import is_inplace


def placement_of(func: Any, tensors: list, cls: type) -> Placement:
    """The placement `func` runs on, given its tensor arguments in order (GlobalTensor or plain)."""
    first = None
    for t in tensors:  # the common case, one placement: no sets, no scalar checks
        if isinstance(t, cls):
            where = t._layout.placement
            if first is None:
                first = where
            elif where != first:
                return _spanning(func, tensors, cls)
    return first  # type: ignore[return-value]


def _spanning(func: Any, tensors: list, cls: type) -> Placement:
    ours = [t for t in tensors if isinstance(t, cls)]
    places = list(dict.fromkeys(t._layout.placement for t in ours))
    anchors = list(dict.fromkeys(t._layout.placement for i, t in enumerate(ours)
                                 if t.dim() > 0 or (i == 0 and t is tensors[0] and is_inplace(func))))
    if len(anchors) > 1:
        raise ValueError(
            f"{func}: inputs live on different placements {sorted(map(repr, anchors))}; move them to one with "
            "x.to_global(placement, sbp) first (operators never pick a placement for you; only 0-dim "
            "scalars may come from another placement)")
    if anchors:
        where = anchors[0]
        for t in ours:
            lay = t._layout
            if lay.placement != where and (any(r not in lay.placement for r in where.flat_ranks)
                                           or lay.has_partial):
                raise ValueError(
                    f"{func}: a 0-dim input laid out {lay.sbp} on {lay.placement} is used on {where}; a scalar from "
                    "another placement must be Broadcast on ranks that include the op's (then it moves nothing); "
                    f"move it first with x.to_global({where!r}, sbp)")
        return where
    kinds = {p.device_type for p in places}
    if len(kinds) > 1:
        raise ValueError(f"{func}: scalar inputs live on placements of different device types {sorted(kinds)}; "
                         "move them to one device type with x.to_global(placement, sbp) first")
    ranks = sorted({r for p in places for r in p.flat_ranks})
    return Placement(places[0].device_type, (len(ranks),), tuple(ranks), places[0].topology)
