"""The op path of ragged tensors: which handler takes a call with a ragged input (`run`).

Pointwise ops, `*_like` factories, unsqueeze/expand and sums are handled here by name; a reshape's
rows go to `views.py`'s reshapes, permutations and products; every other op to `rules.py`'s general
path (its rule passes a split of the ragged dim through); what none takes is balanced (a reshape's
rows) or refused. The class sits above (`tensor.py`) and hands down each call and itself (`cls`), as
`GlobalTensor` hands the dispatcher its class: the handlers build outputs with `cls.make`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..boxing import ragged as _recut
from ..layout import Layout
from ..ops.pointwise import cast_meta, elementwise_meta
from ..ops.registry import RULES, is_inplace
from ..runtime import context
from ..sbp import Broadcast, Partial, Ragged, Split, split_range
from ..tensor import GlobalTensor
from .cuts import _NOT_TAKEN, Sizes, _balanced_sbp, _shown
from .rules import _by_rule
from .views import _MATMULS, _PERMUTES, _RESHAPES, _balance, _mm, _permute, _reshape

aten = torch.ops.aten
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}
_SUMS = {aten.sum.default, aten.sum.dim_IntList}


def _is_pointwise(func: Any) -> bool:
    rule = RULES.get(func)
    return rule is not None and rule.meta in (elementwise_meta, cast_meta)


def run(func: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    """`func` on arguments of which at least one is of the ragged class `cls`."""
    flat, _ = tree_flatten((args, kwargs))
    ragged = [t for t in flat if isinstance(t, cls)]
    first = ragged[0]
    if func in _SUMS:
        return _sum(func, args, kwargs, cls)
    if func in _LIKE or _is_pointwise(func):
        if all(t._auto for t in ragged) and any(_held_axes(t, tuple(first.shape), first._layout) is None for t in flat
                                               if isinstance(t, GlobalTensor) and not isinstance(t, cls)):
            return _on_balanced(func, args, kwargs, cls)   # a reshape's rows meet another split: balanced, then the op
        return _pointwise(func, args, kwargs, flat, first, cls)
    if func is aten.detach.default or func is aten.alias.default:
        return _pointwise(func, args, kwargs, flat, first, cls)
    if func in (aten.unsqueeze.default, aten.expand.default) and args[0] is first and len(ragged) == 1:
        return _new_dims(func, args, kwargs, cls)
    auto = all(t._auto for t in ragged)
    out = _NOT_TAKEN
    if auto:  # a reshape's ragged rows: a Linear's reshapes, permutations and products keep them
        if func in _RESHAPES and args[0] is first and len(ragged) == 1:
            out = _reshape(func, args, kwargs, cls)
        elif func in _PERMUTES and len(ragged) == 1:
            out = _permute(func, args, kwargs, cls)
        elif func in _MATMULS:
            out = _mm(func, args, kwargs, cls)
    if out is _NOT_TAKEN:
        out = _by_rule(func, args, kwargs, ragged, cls)
    if out is not _NOT_TAKEN:
        return out
    if auto:  # ops that do not keep a reshape's rows get them balanced
        return _on_balanced(func, args, kwargs, cls)
    at = next(i for i, t in enumerate(t for t in flat if isinstance(t, torch.Tensor)) if t is first)
    # NotImplementedError, not TypeError: torch turns a TypeError inside `x @ w` into "unsupported operand"
    raise NotImplementedError(f"{func}: tensor input {at} is ragged ({first._layout.sbp}, sizes {_shown(first._sizes)}); "
                    "ragged tensors are taken by ops that work along other dims (their rule passes a split of the "
                    "ragged dim through), sums, conversions and the grouped ops (gt.grouped_linear); convert it "
                    "to a balanced split first: "
                    f"x.to_global(x.placement, {_balanced_sbp(first._layout)})")


def _on_balanced(func: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    """The op on its ragged inputs' balanced splits (a reshape's rows, for an op that does not keep them)."""
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        raise NotImplementedError(f"{func}: writes a ragged input in place (the rows of a reshape of an uneven split, "
                                  "which it does not take); the balanced copy it would write is not the tensor: "
                                  "reshape a balanced split first, or write out of place")
    balanced = tree_map(lambda t: _balance(t) if isinstance(t, cls) else t, (args, kwargs))
    return func(*balanced[0], **balanced[1])


def _pointwise(func: Any, args: tuple, kwargs: dict, flat: list, first: GlobalTensor, cls: type) -> Any:
    """The op on the shards: ragged operands must share layout and sizes; a Broadcast operand is cut to the
    rows this rank holds (a local slice); the outputs take the first ragged input's layout and sizes."""
    layout, sizes = first._layout, first._sizes
    if layout.has_partial:
        raise TypeError(f"{func}: a ragged input with a Partial axis ({layout.sbp}) is not taken by pointwise ops; "
                        "reduce it first")
    comm = context.current()
    inside = layout.placement.coord(comm.rank) is not None
    shapes = [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]
    shape = shapes[0] if func in _LIKE or is_inplace(func) else tuple(torch.broadcast_shapes(*shapes))

    def local(t: Any) -> Any:
        if isinstance(t, cls):
            if t._layout != layout or t._sizes != sizes:
                raise ValueError(f"{func}: ragged inputs of different layouts or sizes ({layout.sbp} sizes "
                                 f"{_shown(sizes)} vs {t._layout.sbp} sizes {_shown(t._sizes)}); convert one to "
                                 "the other's (x.to_global(sbp=..., sizes=...))")
            return t._local
        if isinstance(t, GlobalTensor):
            held = _held_axes(t, shape, layout)
            if held is None:
                raise ValueError(f"{func}: a ragged tensor meets a {t.sbp} one; other operands of a ragged one must "
                                 "be ragged alike or Broadcast on its placement (or split as it is on its other axes)")
            return _cut_operand(func, t._local, tuple(t.shape), shape, layout, sizes, held) if inside else t._local
        if isinstance(t, torch.Tensor) and t.dim() > 0:  # outside the placement: an empty shard, like the others
            return _cut_operand(func, t, tuple(t.shape), shape, layout, sizes) if inside else t.new_empty((0,))
        return t

    largs, lkwargs = tree_map(local, (args, kwargs))
    result = func(*largs, **lkwargs)
    if is_inplace(func):
        return args[0]
    unit = first._unit if all(t._auto for t in flat if isinstance(t, cls)) else None
    return tree_map(lambda o: cls.make(o, layout, shape if o.dim() == len(shape) else tuple(first.shape), sizes,
                                   unit=unit) if isinstance(o, torch.Tensor) else o, result)


def _held_axes(t: GlobalTensor, out_shape: tuple, layout: Layout) -> Optional[frozenset]:
    """The mesh axes on which a non-ragged operand of a ragged pointwise op already holds its block (split as
    the ragged tensor is there: a per-expert bias beside rows split by expert); None if some axis of it is
    neither that nor Broadcast."""
    if t.placement != layout.placement:
        return None
    lead = len(out_shape) - t.dim()
    held = set()
    for a, (s, r) in enumerate(zip(t.sbp, layout.sbp)):
        if isinstance(s, Broadcast):
            continue
        if not (isinstance(s, Split) and isinstance(r, Split) and r.dim == s.dim + lead
                and t.shape[s.dim] == out_shape[r.dim]):
            return None
        held.add(a)
    return frozenset(held)


def _cut_operand(func: Any, t: torch.Tensor, t_shape: tuple, out_shape: tuple, layout: Layout,
                 sizes: Sizes, held: frozenset = frozenset()) -> torch.Tensor:
    """A whole operand broadcast against the ragged output: the block of each cut dim it spans (a local slice;
    none on the axes in `held`, where the operand is split alike already)."""
    coord = layout.placement.coord(context.current().rank)
    lead = len(out_shape) - len(t_shape)
    for a, s in enumerate(layout.sbp):
        if not isinstance(s, (Split, Ragged)) or a in held:
            continue
        d = s.dim - lead
        if d < 0 or t_shape[d] == 1:
            continue
        if isinstance(s, Split):  # cut in mesh-axis order, as Layout.shard does
            t = t.narrow(d, *split_range(t.shape[d], layout.placement.shape[a], coord[a]))
        else:
            t = _recut.take(t, d, sizes[a], coord[a])
    return t


def _new_dims(func: Any, args: tuple, kwargs: dict, cls: type) -> GlobalTensor:
    """unsqueeze and expand (a sum's backward) add dims or widen size-1 ones; the cut dims shift, unchanged."""
    x = args[0]
    ndim = x.dim()
    if func is aten.unsqueeze.default:
        at = args[1] % (ndim + 1)
        moved = [d + (d >= at) for d in range(ndim)]
        shape = tuple(x.shape[:at]) + (1,) + tuple(x.shape[at:])
        local_args = (x._local, at)
    else:
        size = list(args[1] if len(args) > 1 else kwargs["size"])
        lead = len(size) - ndim
        moved = [d + lead for d in range(ndim)]
        shape = tuple(n if n != -1 else x.shape[i - lead] for i, n in enumerate(size))
        for s in x._layout.sbp:
            if isinstance(s, (Split, Ragged)) and shape[s.dim + lead] != x.shape[s.dim]:
                raise TypeError(f"{func}: expands dim {s.dim}, which {s!r} cuts; convert it first")
        cut = {s.dim + lead for s in x._layout.sbp if isinstance(s, (Split, Ragged))}
        local_args = (x._local, [-1 if i in cut else shape[i] for i in range(len(size))])  # size-1 dims widen
    sbp = tuple(type(s)(moved[s.dim]) if isinstance(s, (Split, Ragged)) else s for s in x._layout.sbp)
    inside = x.placement.coord(context.current().rank) is not None
    local = func(*local_args) if inside else x._local
    return cls.make(local, Layout(x.placement, sbp), shape, x._sizes, unit=x._unit)


def _sum(func: Any, args: tuple, kwargs: dict, cls: type) -> GlobalTensor:
    """A sum keeps the ragged cut of the dims it keeps; over a cut dim each rank's part is a term (Partial)."""
    x = args[0]
    if any(isinstance(t, torch.Tensor) for t in tree_flatten((args[1:], kwargs))[0]):
        raise TypeError(f"{func}: only the summed tensor may be a tensor argument")
    if x._layout.has_partial:
        raise TypeError(f"{func}: a ragged input with a Partial axis ({x._layout.sbp}) cannot be summed here")
    ndim = x.dim()
    if func is aten.sum.default:
        dims, keep = list(range(ndim)), False
    else:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dims = list(range(ndim)) if not dims else [d % ndim for d in dims]
    sbp, sizes = [], []
    for a, s in enumerate(x._layout.sbp):
        if isinstance(s, (Split, Ragged)) and s.dim in dims:
            sbp.append(Partial())
            sizes.append(None)
        elif isinstance(s, (Split, Ragged)):
            d = s.dim if keep else s.dim - sum(k < s.dim for k in dims)
            sbp.append(type(s)(d))
            sizes.append(x._sizes[a])
        else:
            sbp.append(s)
            sizes.append(None)
    shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape) if keep or d not in dims)
    layout = Layout(x.placement, tuple(sbp))
    inside = x.placement.coord(context.current().rank) is not None
    largs = (x._local,) + tuple(args[1:])
    local = func(*largs, **kwargs) if inside else x._local.new_empty((0,))
    return cls.make(local, layout, shape, tuple(sizes) if layout.ragged_axes else None, unit=x._unit)
