"""Any op whose rule passes a split of the ragged dim through, run on the shards with no data moved.

An op that works along dims other than the ragged one (softmax, topk, one_hot, cumsum and argsort
along others, bmm over it as the batch) needs no ragged-specific code: its own rule decides as for
a balanced split of the ragged dim, and a signature that boxes nothing holds for any cut of it.
This is that general path (`_by_rule`, its decision `_choose_passing`, the kernel's view of the
true shards `_RaggedLocal`), kept apart from the few ops `run.py` handles by name.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch.utils._pytree import tree_flatten

from ..boxing import ragged as _recut
from ..layout import Layout
from ..ops.decide import valid, axis_candidates, flatten_out, map_tensors
from ..ops.errors import data_dependent
from ..ops.registry import RULES, Ctx, Local, Rule, is_inplace
from ..placement import Placement
from ..runtime import context
from ..sbp import Broadcast, Partial, Ragged, Split
from ..tensor import GlobalTensor
from .cuts import _NOT_TAKEN, Sizes, _balanced_sbp, _inside, _shown


class Passing(NamedTuple):
    """`_choose_passing`'s decision for one call, cached by its key."""
    rule: Rule
    ctx: Ctx
    stand_ins: tuple     # per input, the layout the rule decided on (a balanced Split(d) for the ragged dim)
    out_layouts: tuple   # per flattened output (None for a None output)
    cuts: tuple          # per input, per mesh axis: the dim a whole operand is cut along (None: kept)
    dtypes: tuple        # per flattened output


class Rows(NamedTuple):
    """The ragged rows the outputs carry on: the ragged mesh axes, their sizes, a reshape's unit (or None)."""
    axes: tuple
    sizes: Sizes
    unit: Optional[int]


_BY_RULE: dict[tuple, Optional[Passing]] = {}  # call key -> its decision, None where no signature passes


def _by_rule(func: Any, args: tuple, kwargs: dict, ragged: list, cls: type) -> Any:
    """An op that works along dims other than the ragged one, run on the shards with no data moved.

    Its rule decides as for a balanced split of the ragged dim (the stand-in), taking only a signature
    that needs no boxing: on each ragged axis the ragged inputs keep `S(d)`, the output is `S(o)` with
    dim o as long as d (its rows are the input's rows: the sizes pass through), Partial (each rank's
    rows are a term) or Broadcast (what the rule computes whole from any shard: `new_zeros`), and an input whole there (Broadcast) stays whole, or, where the signature splits
    it along a dim as long as the ragged one, gets this rank's rows (a local slice); on every other axis
    each input stays as it is. Such a signature holds for any cut of d, not only the balanced one. The
    kernel sees the true shards (`_RaggedLocal`: shapes and boxes from the sizes). Not taken (None
    cached) otherwise: the caller balances a reshape's rows or refuses."""
    first = ragged[0]
    p, axes, sizes = first.placement, first._layout.ragged_axes, first._sizes
    length = first.shape[first._layout.sbp[axes[0]].dim]
    tensors: list = []
    map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    for t in ragged:
        if t.placement != p or t._layout.ragged_axes != axes or t._sizes != sizes or \
                t.shape[t._layout.sbp[axes[0]].dim] != length:
            return _NOT_TAKEN
    if any(isinstance(t, GlobalTensor) and t.placement != p for t in tensors):
        return _NOT_TAKEN
    key = _rule_key(func, args, kwargs)
    chosen = _BY_RULE.get(key, _NONE)
    if chosen is _NONE:
        if len(_BY_RULE) >= 4096:   # bounded, as the dispatcher's programs are
            _BY_RULE.clear()
        chosen = _BY_RULE[key] = _choose_passing(func, args, kwargs, tensors, p, axes, length, cls)
    if chosen is None:
        return _NOT_TAKEN
    rule, ctx, stand_ins, out_layouts, cuts, _ = chosen
    rows = Rows(axes, sizes, first._unit if all(t._auto for t in ragged) else None)
    if is_inplace(func) and not (isinstance(args[0], cls) and out_layouts[0] == stand_ins[0]):
        return _NOT_TAKEN   # writes its target where it is, or not here
    if not _inside(first._layout):
        result = [None if lay is None else first._local.new_empty((0,), dtype=dt)
                  for lay, dt in zip(out_layouts, chosen.dtypes)]
        return _wrap_outputs(cls, chosen, rows, result)
    rank = context.current().rank
    coord = p.coord(rank)

    def shard(t: Any, i: int) -> Any:
        local = t._local if isinstance(t, GlobalTensor) else t
        for a in axes:  # a whole operand split by the signature along a dim as long as the ragged one
            if cuts[i][a] is not None:
                local = _recut.take(local, cuts[i][a], sizes[a], coord[a])
        return local
    largs, lkwargs = map_tensors(args, kwargs, shard)
    where = _RaggedLocal(ctx, stand_ins, out_layouts, rank, sizes=sizes, axes=axes)
    got = func(*largs, **lkwargs) if rule.local is None else rule.local(func, largs, lkwargs, where)
    if is_inplace(func):
        return args[0]
    result, _ = flatten_out(got)
    for j, (o, lay) in enumerate(zip(result, out_layouts)):
        if lay is not None and tuple(o.shape) != where.out_shape(j):
            raise AssertionError(f"{func}: its kernel gave a shard of shape {tuple(o.shape)} for output {j}, "
                                 f"not the {where.out_shape(j)} that {lay.sbp} with sizes {_shown(sizes)} holds")
    return _wrap_outputs(cls, chosen, rows, result, got)


def _wrap_outputs(cls: type, chosen: Passing, rows: Rows, result: list, got: Any = None) -> Any:
    """The kernel's shards as global tensors: ragged where the rows passed through, plain where Partial.
    `got`: the kernel's output, whose structure they take (None: outside the placement, no kernel ran)."""
    wrapped = []
    for o, lay, shape in zip(result, chosen.out_layouts, chosen.ctx.out_shapes):
        if lay is None or o is None:
            wrapped.append(o)
            continue
        if any(isinstance(lay.sbp[a], Split) for a in rows.axes):
            lay = Layout(lay.placement, tuple(Ragged(s.dim) if a in rows.axes else s for a, s in enumerate(lay.sbp)))
            wrapped.append(cls.make(o, lay, shape, rows.sizes, unit=rows.unit))
        else:
            wrapped.append(cls.make(o, lay, shape, None))
    if got is None:
        return wrapped[0] if len(wrapped) == 1 and len(chosen.out_layouts) == 1 else tuple(wrapped)
    return flatten_out(got)[1](wrapped)


def _rule_key(func: Any, args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    return (func, spec) + tuple(t._key if isinstance(t, GlobalTensor) else
                                ("plain", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                                for t in leaves)


_NONE = object()


def _choose_passing(func: Any, args: tuple, kwargs: dict, tensors: list, p: Placement, axes: tuple,
                    length: int, cls: type) -> Optional[Passing]:
    """`_by_rule`'s decision, or None where no signature passes the rows through."""
    rule = RULES.get(func)
    if rule is None or rule.decompose is not None and rule.decompose_when is None:
        return None
    bcast = Layout(p, (Broadcast(),) * p.ndim)
    srcs = tuple(Layout(p, _balanced_sbp(t._layout)) if isinstance(t, GlobalTensor) else bcast for t in tensors)
    try:
        meta_args, meta_kwargs = map_tensors(args, kwargs, lambda t, i: torch.empty(
            tuple(t.shape), dtype=t.dtype, device="meta"))
        outs, _ = flatten_out(func(*meta_args, **meta_kwargs) if rule.meta is None else
                              rule.meta(func, meta_args, meta_kwargs))
    except Exception as e:
        if data_dependent(e):
            return None
        raise
    ctx = Ctx(func, tuple(tuple(t.shape) for t in tensors), tuple(None if o is None else tuple(o.shape) for o in outs),
              meta_args, meta_kwargs, p.shape)
    if rule.decompose is not None and rule.decompose_when(ctx, srcs):
        return None
    cands = axis_candidates(ctx, rule, len(tensors), len(outs))
    ragged = [isinstance(t, cls) for t in tensors]
    per_axis, cut_dims = [], []
    for a in range(p.ndim):
        fits, cuts = [], []
        for ins, outs_sbp in cands:
            cut = _passes(ins, outs_sbp, a, a in axes, srcs, ctx, ragged, length)
            if cut is not None:
                fits.append((ins, outs_sbp))
                cuts.append(cut)
        if not fits:
            return None
        per_axis.append(fits)
        cut_dims.append(cuts)
    best = None
    for pick in itertools.product(*[range(len(f)) for f in per_axis]):
        combo = [per_axis[a][k] for a, k in enumerate(pick)]
        targets = tuple(Layout(p, tuple(sig[0][i] for sig in combo)) for i in range(len(tensors)))
        out_layouts = tuple(None if outs[j] is None else Layout(p, tuple(sig[1][j] for sig in combo))
                            for j in range(len(outs)))
        if any(lay is not None and any(isinstance(lay.sbp[a], Split) for a in axes) and
               not all(isinstance(lay.sbp[a], Split) and lay.sbp[a].dim == lay.sbp[axes[0]].dim for a in axes)
               for lay in out_layouts):
            continue   # an output's rows pass through on every ragged axis alike, or on none
        if rule.kernel_cost is not None and rule.kernel_cost(ctx, srcs, targets, out_layouts) != ((), 0):
            continue   # a kernel that communicates itself (a scan along the split dim) works along it
        partials = sum(lay is not None and lay.has_partial for lay in out_layouts)
        if (best is None or partials < best[0]) and valid(ctx, rule, targets, out_layouts, p):
            cuts = tuple(tuple(cut_dims[a][k][i] for a, k in enumerate(pick)) for i in range(len(tensors)))
            best = (partials, Passing(rule, ctx, targets, out_layouts, cuts,
                                      tuple(None if o is None else o.dtype for o in outs)))
            if not partials:
                break
    return None if best is None else best[1]


def _passes(ins: tuple, outs: tuple, axis: int, is_ragged: bool, srcs: tuple, ctx: Ctx, ragged: list,
            length: int) -> Optional[tuple]:
    """Whether one axis' signature takes the inputs as they are (see `_by_rule`); then per input the dim
    a whole operand is cut along on a ragged axis (None: kept as it is), else None."""
    cuts = []
    for i, (want, src) in enumerate(zip(ins, srcs)):
        have = src.sbp[axis]
        if want == have and (not is_ragged or ragged[i] or isinstance(have, Broadcast)):
            cuts.append(None)
        elif is_ragged and isinstance(have, Broadcast) and isinstance(want, Split) and \
                ctx.shapes[i][want.dim] == length:
            cuts.append(want.dim)
        else:
            return None
    if is_ragged and not any(c is None and r for c, r in zip(cuts, ragged)):
        return None
    if is_ragged and any(o is not None and not (isinstance(o, (Partial, Broadcast)) or isinstance(o, Split) and
                                                ctx.out_shapes[j][o.dim] == length)
                         for j, o in enumerate(outs) if ctx.out_shapes[j] is not None):
        return None
    return tuple(cuts)


@dataclass(frozen=True)
class _RaggedLocal(Local):
    """A kernel's `Local` where the ragged axes cut as the sizes say: the layouts hold the balanced
    stand-ins (Split(d)), the shapes and boxes are the true shards' (a random op draws its true rows)."""
    sizes: Sizes = ()
    axes: tuple = ()

    def out_shape(self, i: int = 0) -> tuple[int, ...]:
        return tuple(n for _, n in self.out_box(i))

    def in_box(self, i: int) -> tuple[tuple[int, int], ...]:
        return self._box(self.in_layouts[i], self.ctx.shapes[i])

    def out_box(self, i: int = 0) -> tuple[tuple[int, int], ...]:
        return self._box(self.out_layouts[i], self.ctx.out_shapes[i])

    def _box(self, layout: Layout, shape: tuple) -> tuple:
        coord = layout.placement.coord(self.rank)
        box = list(Layout(layout.placement, tuple(Broadcast() if a in self.axes else s for a, s in
                                                  enumerate(layout.sbp))).shard(shape, self.rank))
        for a in self.axes:
            s = layout.sbp[a]
            if isinstance(s, Split):
                start, _ = box[s.dim]
                box[s.dim] = (start + sum(self.sizes[a][:coord[a]]), self.sizes[a][coord[a]])
        return tuple(box)
