"""Reshapes, permutations and matrix products of a reshape's ragged rows: what a Linear over [G, S, d] runs.

A reshape that merges an unevenly split dim with the dims inside it makes ragged rows in units
(`merged_view`, which `ops/view.py`'s reshape rule reaches through `GlobalTensor.of_kind("ragged")`); these handlers keep
such rows ragged, with no data moved, through the reshapes, transposes and products a Linear runs
on them (no rule passes a split through a merge of dims, so `rules.py` does not take these,
and an op nothing takes gets the rows balanced: `_balance`, one uneven all-to-all). They give
`_NOT_TAKEN` for anything else, and build their outputs with the class they are handed (`cls.make`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from ..boxing import ragged as _recut
from ..layout import Layout
from ..ops import view as _view
from ..runtime import context
from ..sbp import Broadcast, Partial, Ragged, Split
from ..tensor import GlobalTensor
from .cuts import _NOT_TAKEN, _inside, _is_balanced, _recut_units, _unit_sizes, local_shape

aten = torch.ops.aten
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.flatten.using_ints,
             aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default}
_PERMUTES = {aten.t.default, aten.transpose.int, aten.permute.default}
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


def _meta_shape(func: Any, args: tuple, kwargs: dict) -> tuple:
    meta = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor)
                    else t, (args, kwargs))
    return tuple(func(*meta[0], **meta[1]).shape)


def _reshaped(cls: type, x: GlobalTensor, layout: Layout, shape: tuple, length: int, unit: int) -> GlobalTensor:
    """x's shard read in `shape` under `layout`, its ragged dim `length` units of `unit` rows (no data moves)."""
    p = layout.placement
    sizes = _unit_sizes(length, unit, p, layout.ragged_axes) if layout.ragged_axes else None
    local = x._local
    if _inside(layout):
        local = local.reshape(local_shape(layout, shape, sizes, context.current().rank) if sizes else
                              layout.local_shape(shape, context.current().rank))
    return cls.make(local, layout, shape, sizes, unit=unit if sizes else None)


def merged_view(func: Any, args: tuple, kwargs: dict, cls: type) -> GlobalTensor:
    """A reshape that merges an unevenly split dim with the dims inside it ([G, S, d] S(0) -> [G*S, d], G not
    a multiple of the ranks): the output is ragged on the merged dim, its sizes the pieces times the inner
    size (`ops/view.py`'s uneven_merge); no data moves. Run by the reshape rule's decomposition."""
    x = args[0]
    ins, outs = tuple(x.shape), _meta_shape(func, args, kwargs)
    axes, d, o, unit = _view.uneven_merge(ins, outs, x._layout)
    carried = _view.reshape_map(ins, outs, x.placement.shape)
    cut = Split(o) if _is_balanced(ins[d], unit, x.placement, axes) else Ragged(o)
    sbp = tuple(cut if a in axes else Split(carried[s.dim]) if isinstance(s, Split) else s
                for a, s in enumerate(x._layout.sbp))
    return _reshaped(cls, x, Layout(x.placement, sbp), outs, ins[d], unit)


def _reshape(func: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    """A reshape of a reshape's ragged rows: the ragged dim, the outer one of its reshape group, carries to
    the outer output dim of the group in units scaled by the inner sizes' ratio ([G*S, d] ragged ->
    [G, S, d] ragged on G, or balanced S(0) where the runs are the balanced ones); other axes broadcast or
    split dims the reshape carries balanced. Anything else is not taken."""
    x = args[0]
    ins, outs = tuple(x.shape), _meta_shape(func, args, kwargs)
    axes = x._layout.ragged_axes
    d = x._layout.sbp[axes[0]].dim
    carried = _view.reshape_map(ins, outs, x.placement.shape)
    if any(not isinstance(s, (Split, Broadcast, Ragged)) or isinstance(s, Split) and s.dim not in carried
           or isinstance(s, Ragged) and s.dim != d for s in x._layout.sbp):
        return _NOT_TAKEN
    for gi, gj in _view.reshape_groups(ins, outs):
        if d not in gi:
            continue
        at = gi.index(d)
        big = [k for k in gj if outs[k] != 1]
        if any(ins[k] != 1 for k in gi[:at]) or not big or any(
                isinstance(s, Split) and s.dim in gi for s in x._layout.sbp):
            return _NOT_TAKEN
        inner_in = int(np.prod([ins[k] for k in gi[at + 1:]]))
        # the outermost output dim whole units land on: a size-1 one too (a single group, [S, d] -> [1, S, d]:
        # its one unit is that dim's one index, a balanced split of it, not S cut [S, 0, ...])
        o = next((k for k in gj[:gj.index(big[0]) + 1]
                  if (x._unit * inner_in) % int(np.prod([outs[j] for j in gj[gj.index(k) + 1:]])) == 0), None)
        if o is None:
            return _NOT_TAKEN
        inner_out = int(np.prod([outs[k] for k in gj[gj.index(o) + 1:]]))
        unit, length = x._unit * inner_in // inner_out, ins[d] // x._unit
        cut = Split(o) if _is_balanced(length, unit, x.placement, axes) else Ragged(o)
        sbp = tuple(cut if a in axes else Split(carried[s.dim]) if isinstance(s, Split) else s
                    for a, s in enumerate(x._layout.sbp))
        return _reshaped(cls, x, Layout(x.placement, sbp), outs, length, unit)
    return _NOT_TAKEN


def _permute(func: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    """t, transpose, permute: the cut dims move with their dims, sizes unchanged."""
    x = args[0]
    n = x.dim()
    if not isinstance(x, cls):
        return _NOT_TAKEN
    perm = list(range(n))
    if func is aten.t.default:
        perm = perm[::-1]
    elif func is aten.permute.default:
        perm = [p % n for p in (args[1] if len(args) > 1 else kwargs["dims"])]
    else:
        a, b = (args[1] if len(args) > 1 else kwargs["dim0"]) % n, (args[2] if len(args) > 2 else kwargs["dim1"]) % n
        perm[a], perm[b] = perm[b], perm[a]
    where = {src: dst for dst, src in enumerate(perm)}
    sbp = tuple(type(s)(where[s.dim]) if isinstance(s, (Split, Ragged)) else s for s in x._layout.sbp)
    local = func(x._local, *args[1:], **kwargs) if _inside(x._layout) else x._local
    return cls.make(local, Layout(x.placement, sbp), tuple(x.shape[p] for p in perm), x._sizes, unit=x._unit)


def _mm(func: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    """Matrix products with ragged rows: rows @ whole -> rows (mm, bmm, addmm with a whole bias), whole @
    ragged columns -> ragged columns, and a product over the ragged dim of two operands cut alike
    (x.t() @ grad: a Linear's weight gradient) -> Partial on the ragged axes. Every other mesh axis
    broadcasts, or (bmm) splits the batch dim of every operand alike (experts split over an expert axis)."""
    if func is aten.addmm.default:
        bias, a, b = args[:3]
        if isinstance(bias, cls):
            return _NOT_TAKEN
    else:
        bias, (a, b) = None, args[:2]
    off = 1 if func is aten.bmm.default else 0
    ra, rb = isinstance(a, cls), isinstance(b, cls)
    first = a if ra else b
    layout, p = first._layout, first.placement
    axes = layout.ragged_axes
    others = tuple(s for k, s in enumerate(layout.sbp) if k not in axes)
    if any(not (isinstance(s, Broadcast) or off and s == Split(0)) for s in others):
        return _NOT_TAKEN
    for t in (bias, a, b):
        if not isinstance(t, GlobalTensor):
            continue
        if t.placement != p or tuple(s for k, s in enumerate(t._layout.sbp) if k not in axes) != others:
            return _NOT_TAKEN
        if not isinstance(t, cls) and not all(isinstance(t._layout.sbp[k], Broadcast) for k in axes):
            return _NOT_TAKEN
    if bias is not None and bias.dim() == 2 and bias.shape[0] != 1:
        return _NOT_TAKEN   # a bias with a row per ragged row: not a Linear's
    dim_a = a._layout.sbp[axes[0]].dim if ra else None
    dim_b = b._layout.sbp[axes[0]].dim if rb else None
    shape = tuple(a.shape[:off]) + (a.shape[off], b.shape[off + 1])
    if ra and rb:
        if dim_a != off + 1 or dim_b != off or a._sizes != b._sizes or a._unit != b._unit or bias is not None \
                or a._layout.ragged_axes != b._layout.ragged_axes:
            return _NOT_TAKEN
        out_sbp, sizes, unit = Partial(), None, None
    elif (ra and dim_a == off + 1 or rb and dim_b == off) and bias is None:  # over the ragged dim, the other whole
        out_sbp, sizes, unit = Partial(), None, None
        whole = 1 if ra else 0
    elif ra and dim_a == off:
        out_sbp, sizes, unit = Ragged(off), a._sizes, a._unit
    elif rb and dim_b == off + 1 and bias is None:
        out_sbp, sizes, unit = Ragged(off + 1), b._sizes, b._unit
    else:
        return _NOT_TAKEN
    out = Layout(p, tuple(out_sbp if k in axes else s for k, s in enumerate(layout.sbp)))
    if _inside(layout):
        largs = [t._local if isinstance(t, GlobalTensor) else t for t in args]
        if isinstance(out_sbp, Partial) and not (ra and rb):  # the whole operand's rows (columns) this rank holds
            coord = p.coord(context.current().rank)
            for k in axes:
                largs[whole] = _recut.take(largs[whole], off + (1 - whole), first._sizes[k], coord[k])
        local = func(*largs, **kwargs)
    else:
        local = first._local.new_empty((0,))
    return cls.make(local, out, shape, sizes, unit=unit)



def _balance(x: GlobalTensor) -> GlobalTensor:
    """A reshape's ragged tensor on the balanced split of its dim (one uneven all-to-all, nothing where the
    runs already are the balanced ones)."""
    axes = x._layout.ragged_axes
    d, p = x._layout.sbp[axes[0]].dim, x.placement
    layout = Layout(p, tuple(Split(d) if a in axes else s for a, s in enumerate(x._layout.sbp)))
    local = x._local
    if _inside(layout):
        local = _recut_units(local, p, axes, d, x.shape[d] // x._unit, x._unit, to_units=False)
    return GlobalTensor(local, layout, tuple(x.shape))


def _unbalance(cls: type, y: GlobalTensor, layout: Layout, unit: int) -> GlobalTensor:
    """The reverse of `_balance`: y (Split(d) where `layout` is ragged) back to the runs in units."""
    axes = layout.ragged_axes
    d, p = layout.sbp[axes[0]].dim, layout.placement
    local = y._local
    if _inside(layout):
        local = _recut_units(local, p, axes, d, y.shape[d] // unit, unit, to_units=True)
    return cls.make(local, layout, tuple(y.shape), _unit_sizes(y.shape[d] // unit, unit, p, axes), unit=unit)
