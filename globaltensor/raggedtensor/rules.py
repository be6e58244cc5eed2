"""Any op whose rule passes a split of the ragged dim through, run on the shards with no data moved.

An op that works along dims other than the ragged one (softmax, topk, one_hot, cumsum and argsort
along others, bmm over it as the batch) needs no ragged-specific code: the one dispatcher decides
it (`ops/decide.py`'s `RaggedRows`: its rule, on a balanced split of the ragged dim, taking only a
signature that moves no data, which holds for any cut of it), from its one cache. This is where
such a decision runs (`_by_rule`, the kernel's view of the true shards `_RaggedShardSite`), kept apart
from the few ops `run.py` handles by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from ..boxing import ragged as _recut
from ..layout import Layout
from ..ops.decide import Decision, flatten_out, map_tensors
from ..ops.dispatch import decision_of
from ..ops.registry import ShardSite, is_inplace
from ..runtime import context
from ..sbp import Broadcast, Ragged, Split
from ..tensor import GlobalTensor
from .cuts import _NOT_TAKEN, Sizes, _inside, _shown


class Rows(NamedTuple):
    """The ragged rows the outputs carry on: the ragged mesh axes, their sizes, a reshape's unit (or None)."""
    axes: tuple
    sizes: Sizes
    unit: Optional[int]


def _every_rank_has_rows(sizes: Any) -> bool:
    """Whether every size in `sizes` (per mesh axis: None, or sizes per rank, nested or not) is positive."""
    if sizes is None:
        return True
    if isinstance(sizes, (tuple, list)):
        return all(_every_rank_has_rows(s) for s in sizes)
    return sizes > 0


def _by_rule(func: Any, args: tuple, kwargs: dict, ragged: list, cls: type) -> Any:
    """An op that works along dims other than the ragged one, run on the shards with no data moved.

    The dispatcher's decision (`RaggedRows`) keeps the ragged inputs' split, and on the ragged axes
    may cut a whole operand along a dim as long as the ragged one: it gets this rank's rows (a local
    slice). The kernel sees the true shards (`_RaggedShardSite`: shapes and boxes from the sizes). Not
    taken where the dispatcher finds no such signature (a fallback or a decomposition), nor for ragged
    inputs cut differently: the caller balances a reshape's rows or refuses."""
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
    dec = decision_of(func, args, kwargs, GlobalTensor)
    if dec is not None and dec.kind == "decompose" and dec.rule.decompose is not None and \
            all(t._auto for t in ragged) and _every_rank_has_rows(sizes):
        # its parts on the ragged rows (a loss's mean over a reshape's uneven rows: the sum of each rank's
        # rows, Partial, over the all-reduced count), each taken ragged or balanced as it can be: balancing
        # the whole op's inputs first cost a 3-rank mesh two all-to-alls a step that 4 ranks do not make.
        # Not where a rank holds no rows: a decomposition's parts may reduce them (softmax's amax of none)
        return dec.rule.decompose(func, args, kwargs)
    if dec is None or dec.kind != "kernel":
        return _NOT_TAKEN
    rows = Rows(axes, sizes, first._unit if all(t._auto for t in ragged) else None)
    if is_inplace(func) and not (isinstance(args[0], cls) and dec.out_layouts[0] == dec.targets[0]):
        return _NOT_TAKEN   # writes its target where it is, or not here
    if not _inside(first._layout):
        result = [None if lay is None else first._local.new_empty((0,), dtype=dt)
                  for lay, dt in zip(dec.out_layouts, dec.out_dtypes)]
        return _wrap_outputs(cls, dec, rows, result)
    rank = context.current().rank
    coord = p.coord(rank)

    def shard(t: Any, i: int) -> Any:
        local = t._local if isinstance(t, GlobalTensor) else t
        for a in axes:  # a whole operand the signature splits along a dim as long as the ragged one
            have, want = dec.sources[i].sbp[a], dec.targets[i].sbp[a]
            if isinstance(have, Broadcast) and isinstance(want, Split):
                local = _recut.take(local, want.dim, sizes[a], coord[a])
        return local
    largs, lkwargs = map_tensors(args, kwargs, shard)
    where = _RaggedShardSite(dec.ctx, dec.targets, dec.out_layouts, rank, sizes=sizes, axes=axes)
    got = func(*largs, **lkwargs) if dec.rule.kernel is None else dec.rule.kernel(func, largs, lkwargs, where)
    if is_inplace(func):
        return args[0]
    result, _ = flatten_out(got)
    for j, (o, lay) in enumerate(zip(result, dec.out_layouts)):
        if lay is not None and tuple(o.shape) != where.out_shape(j):
            raise AssertionError(f"{func}: its kernel gave a shard of shape {tuple(o.shape)} for output {j}, "
                                 f"not the {where.out_shape(j)} that {lay.sbp} with sizes {_shown(sizes)} holds")
    return _wrap_outputs(cls, dec, rows, result, got)


def _wrap_outputs(cls: type, dec: Decision, rows: Rows, result: list, got: Any = None) -> Any:
    """The kernel's shards as global tensors: ragged where the rows passed through, plain where Partial.
    `got`: the kernel's output, whose structure they take (None: outside the placement, no kernel ran)."""
    wrapped = []
    for o, lay, shape in zip(result, dec.out_layouts, dec.out_shapes):
        if lay is None or o is None:
            wrapped.append(o)
            continue
        if any(isinstance(lay.sbp[a], Split) for a in rows.axes):
            lay = Layout(lay.placement, tuple(Ragged(s.dim) if a in rows.axes else s for a, s in enumerate(lay.sbp)))
            wrapped.append(cls.make(o, lay, shape, rows.sizes, unit=rows.unit))
        else:
            wrapped.append(cls.make(o, lay, shape, None))
    if got is None:
        return wrapped[0] if len(wrapped) == 1 and len(dec.out_layouts) == 1 else tuple(wrapped)
    return flatten_out(got)[1](wrapped)


@dataclass(frozen=True)
class _RaggedShardSite(ShardSite):
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
