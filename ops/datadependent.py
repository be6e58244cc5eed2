"""Ops whose output shapes depend on the values: `unique`, `nonzero`, `masked_select`, and `x[mask]`.

What they return: Broadcast GlobalTensors on the input's placement, the same on every rank. A split
result would need per-rank sizes known only after running (a ragged split, which layouts do not have),
so the inputs are made whole (boxed to Broadcast, as any conversion), every rank of the placement runs
the op on the whole, and ranks outside the placement learn the shapes with one small collective and
hold empty shards, as everywhere. This is a rule, not a fallback: nothing is warned or counted.

A boolean (or uint8) mask index is torch's own rewriting: `x[mask]` is `x[mask.nonzero().unbind(1)]`.
Only the mask is made whole (one byte per element); the integer indices then follow the indexing rules,
so `x` stays where it is when split off the masked dims. The same for `x[mask] = v` (index_put).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..layout import Layout
from ..runtime import context
from ..sbp import Broadcast
from . import indexing  # noqa: F401  (registers the index rules this module extends)
from .decide import flatten_out, map_tensors, placement_of
from .inputs import box_global
from .keys import geometry_of
from .registry import RULES, Rule, aten, no_signatures, overloads, register

_MASKS = (torch.bool, torch.uint8)


def whole(func: Any, args: tuple, kwargs: dict) -> Any:
    """The op run on the whole inputs on every rank of their placement; outputs Broadcast."""
    tensors: list = []
    map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    cls = next(type(t) for t in tensors if hasattr(t, "_layout"))
    placement = placement_of(func, tensors, cls)
    bcast = Layout(placement, (Broadcast(),) * placement.ndim)
    comm = context.current()
    inside = placement.coord(comm.rank) is not None
    largs, lkwargs = map_tensors(args, kwargs, lambda t, i: box_global(t, bcast) if isinstance(t, cls) else t)
    outs, rebuild = flatten_out(func(*largs, **lkwargs)) if inside else (None, None)
    if comm.world_size > placement.size:  # ranks outside learn the shapes from the first rank inside
        metas = [None if o is None else (tuple(o.shape), o.dtype, _geometry(o)) for o in outs] if inside else None
        got = comm.all_gather_object(metas if comm.rank == placement.flat_ranks[0] else None,
                                     tuple(range(comm.world_size)))
        metas = next((g for g in got if g is not None), None)
        if metas is None:  # the rank inside was at another collective: a pipeline stage's share of the schedule
            raise RuntimeError(
                f"{func}: its output's shape is data-dependent, known only to the ranks of its placement "
                f"{placement}, and a rank outside it runs this op here: a pipeline's rank outside a stage runs the "
                "stage's module once on empty shards (its first step) to learn the layouts of its output and "
                "gradients, while the stage's ranks run another part of the schedule, so no collective can tell "
                "it the shape (nor a Python loop or branch over the values, as transformers' eager experts loop "
                "over the experts hit); compute it outside the pipeline's stages, or with a shape that does not "
                "depend on values (transformers' MoE: the default grouped experts, not "
                "experts_implementation='eager')")
        if not inside:
            device = comm.device_for(placement.device_type)
            outs = [None if m is None else torch.empty((0,), dtype=m[1], device=device) for m in metas]
            shapes = [None if m is None else m[0] for m in metas]
            wrapped = [None if o is None else cls(o, bcast, m[0], geometry=m[2]) for o, m in zip(outs, metas)]
            return tuple(wrapped) if len(wrapped) > 1 else wrapped[0]
    return rebuild([None if o is None else cls(o, bcast, tuple(o.shape), geometry=_geometry(o)) for o in outs])


def _geometry(o: torch.Tensor) -> Any:
    """The strides and offset of an output computed whole: one device's (nonzero's are column-major)."""
    return geometry_of(o.shape, o.stride(), o.storage_offset()) if o.layout is torch.strided else None


def _as_integer_indices(indices: list) -> tuple[list, bool]:
    """Each boolean/uint8 mask replaced by the integer indices of its True entries (one per mask dim)."""
    out, changed = [], False
    for t in indices:
        if t is not None and t.dtype in _MASKS:
            nz = aten.nonzero.default(t if t.dtype == torch.bool else aten.ne.Scalar(t, 0))
            out += list(aten.unbind.int(nz, 1))
            changed = True
        else:
            out.append(t)
    return out, changed


def masked_index(func: Any, args: tuple, kwargs: dict) -> Any:
    """`x[mask]`, `x[mask] = v`: the mask made integer indices, then the op's own rule."""
    indices, changed = _as_integer_indices(list(args[1]))
    if not changed:  # not reached: integer indices are decided by the indexing rule
        raise AssertionError(f"{func}: decomposed without a mask")
    return func(args[0], indices, *args[2:], **kwargs)


def has_mask(ctx: Any, layouts: tuple) -> bool:
    """A boolean/uint8 index. `x[mask]` has no meta kernel and is decomposed before any rule is asked;
    `index_put` (`x[mask] = v`, and x[mask]'s backward) has one, as its output is x's shape, and the
    indexing rule would take the mask for integer indices."""
    return any(t is not None and t.dtype in _MASKS for t in ctx.args[1])


DATA_DEPENDENT = overloads("_unique2", "unique_dim", "unique_consecutive", "nonzero", "masked_select",
                           "argwhere")
register([getattr(p, o) for p in DATA_DEPENDENT for o in p.overloads() if o in ("default",)],
         Rule(no_signatures, decompose=whole))
for op in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
    RULES[op] = replace(RULES[op], decompose=masked_index, decompose_when=has_mask)
