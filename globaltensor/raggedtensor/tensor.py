"""The `RaggedTensor` class, `make` (the one way to build one) and its conversions between cuts.

The class and its conversions live together because each needs the other: `to_global` is a
conversion, and every conversion builds its result with `make`. The op path (`run.py`) sits below:
the class hands it the call and itself (`__torch_dispatch__`), as `GlobalTensor` hands the dispatcher
its class, and the handlers build their outputs with `cls.make`.
"""
from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence

import torch

from ..boxing import convert_local
from ..boxing.boxes import intersect, numel, relative
from ..boxing import ragged as _recut
from ..layout import Layout, normalize_sbp, slice_box
from ..placement import Placement
from ..runtime import context
from ..runtime.symmetry import CHECKING as _SYMMETRY
from ..sbp import Broadcast, Ragged, Split, split_sizes
from ..tensor import GlobalTensor, grad_layout
from .cuts import (Sizes, _balanced, _balanced_sbp, _box_at, _cuts, _outer_splits_ragged, _runs_of_layout, check_sizes,
                   runs_sizes)
from .run import run as _run_op
from .views import _balance, _unbalance, merged_view


class RaggedTensor(GlobalTensor, kind="ragged"):
    """A GlobalTensor with `_sizes`: for each mesh axis that is `Ragged(d)`, the rows of d per rank."""

    _sizes: Sizes
    # rows per element of a balanced split's dim where a reshape made the ragged split (ops/view.py's
    # uneven_merge): the sizes are that split's pieces times it (nested where several axes cut); None otherwise
    _unit: Optional[int]
    __slots__ = ["_sizes", "_unit"]

    @property
    def _auto(self) -> bool:
        return self._unit is not None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def merged_view(cls, func: Any, args: tuple, kwargs: dict) -> GlobalTensor:
        """A reshape merging a split dim unevenly into another (`ops/view.py`'s reshape rule, through
        `GlobalTensor.of_kind("ragged")`): the merged dim's rows per rank become ragged sizes; no data moves."""
        return merged_view(func, args, kwargs, cls)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Any call with a ragged input lands here (the subclass is asked first), never in the dispatcher."""
        return _run_op(func, args, kwargs or {}, RaggedTensor)

    @classmethod
    def make(cls, local: torch.Tensor, layout: Layout, shape: Sequence[int], sizes: Sizes,
             requires_grad: bool = False, unit: Optional[int] = None) -> GlobalTensor:
        """The tensor for a layout and sizes: ragged where the layout is, a plain GlobalTensor otherwise.

        A classmethod so that the op path below this module (`run.py`, `views.py`, `rules.py`) builds its
        outputs from the class it is handed, importing nothing above it. `unit`: the ragged split came from
        a reshape of a balanced one (its sizes are that split's pieces times `unit`), not from the user or a
        grouped op; an op that does not take ragged inputs then converts it to the balanced split instead
        of refusing."""
        shape = tuple(shape)
        if not layout.ragged_axes:
            return GlobalTensor(local, layout, shape, requires_grad=requires_grad)
        layout, sizes = _outer_splits_ragged(layout, shape, sizes)
        _SYMMETRY.sizes = sizes  # what a symmetric dry run checks the shards' shapes by (runtime/symmetry.py)
        try:
            r = GlobalTensor.__new__(cls, local, layout, shape, requires_grad)
        finally:
            _SYMMETRY.sizes = None
        r._sizes = sizes
        r._unit = unit
        return r

    @property
    def sizes(self) -> Sizes:
        return self._sizes

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"RaggedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placement={self.placement}, "
                f"sbp={self.sbp}, sizes={self._sizes}, local={self._local})")

    def __reduce_ex__(self, proto: int):
        raise TypeError("torch.save: a ragged tensor's sizes are data of one step; convert it to a balanced "
                        "split first (x.to_global(placement, gt.split(d)))")

    def to_local(self) -> torch.Tensor:
        return _ToLocal.apply(self)

    def to_global(self, placement: Placement | None = None, sbp: Any = None, grad_sbp: Any = None,
                  sizes: Any = None) -> GlobalTensor:
        """Re-cut (ragged <-> balanced, ragged <-> ragged: one uneven all-to-all), gather or box onwards."""
        if grad_sbp is not None:
            raise ValueError("to_global(grad_sbp): not taken by a ragged tensor (its gradient keeps its sizes)")
        placement = self.placement if placement is None else placement
        if placement != self.placement:
            raise ValueError("to_global(placement): a ragged tensor converts on its own placement; convert it to "
                             "a balanced split (gt.split(d)) first, then move that")
        layout = Layout(placement, normalize_sbp(self.sbp if sbp is None else sbp, placement.ndim))
        return convert(self, layout, sizes)

    def full_tensor(self) -> torch.Tensor:
        return convert(self, Layout(self.placement, (Broadcast(),) * self.placement.ndim), None).full_tensor()


make = RaggedTensor.make


# -- conversions ------------------------------------------------------------------------------------
def convert(x: GlobalTensor, dst: Layout, sizes: Any, unit: Optional[int] = None) -> GlobalTensor:
    """x in layout `dst` (with `sizes` for its ragged axes); differentiable, the backward the reverse.
    `unit`: the sizes are a reshape's runs (`RaggedTensor._unit`, taken from the tensor they came from)."""
    out = _convert(x, dst, sizes, nested=unit is not None, unit=unit)
    if unit is not None and isinstance(out, RaggedTensor) and out is not x:
        out._unit = unit
    return out


def _convert(x: GlobalTensor, dst: Layout, sizes: Any, nested: bool = False, unit: Optional[int] = None) -> GlobalTensor:
    if dst.ragged_axes:
        sizes = check_sizes(sizes, dst, x.shape, "to_global(sizes)", nested)
    elif sizes is not None:
        check_sizes(sizes, dst, x.shape, "to_global(sizes)")  # raises: nothing to cut
    if dst == x._layout and sizes == getattr(x, "_sizes", None):
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _Convert.apply(x, dst, sizes, unit)
    return _convert_now(x, dst, sizes, unit)


def _convert_now(x: GlobalTensor, dst: Layout, sizes: Sizes, unit: Optional[int] = None) -> GlobalTensor:
    """Axis by axis: the ragged axes re-cut, gathered or sliced; everything else boxed as usual.

    First every ragged axis of x that dst does not keep as it is becomes dst's (ragged -> ragged,
    ragged -> balanced: re-cut; ragged -> Broadcast: gather) or, if dst wants anything else there,
    a balanced split the planner takes on from. Then the non-ragged rest is boxed (one route), with
    the axes that dst wants ragged taken as balanced splits (or Broadcast), and re-cut (or sliced).
    """
    a = _inner_swap(x._layout, getattr(x, "_sizes", None), dst, sizes, tuple(x.shape))
    if a is not None:  # one axis from rows of d to a split of another dim, or back: one all-to-all in its groups
        comm, p, shape = context.current(), x.placement, tuple(x.shape)
        s, t = x._layout.sbp[a], dst.sbp[a]
        local = x._local
        if p.coord(comm.rank) is not None:
            run = unit if unit is not None else getattr(x, "_unit", None)

            def cuts(q: int) -> tuple:   # (source, target) sizes on axis a of rank q's group
                return (_axis_sizes(x._layout, shape, getattr(x, "_sizes", None), run, q, a),
                        _axis_sizes(dst, shape, sizes, run, q, a))
            # as the planner does for balanced splits: no collective where nothing changes hands on any rank
            moves = any(_recut.moves(*cuts(q)) for q in p.flat_ranks if p.coord(q)[a] == 0)
            local = _recut.swap(local, s.dim, *cuts(comm.rank)[:1], t.dim, cuts(comm.rank)[1],
                                p.group(comm.rank, a), comm, moves)
        return make(local, dst, shape, sizes if dst.ragged_axes else None)
    if unit is not None and (len(x._layout.ragged_axes) > 1 or len(dst.ragged_axes) > 1) and _runs_of(x, unit) \
            and _runs_of_layout(dst, sizes, tuple(x.shape), unit):
        return _exchange_runs(x, dst, sizes, unit)   # nested runs re-cut on several axes at once
    if isinstance(x, RaggedTensor) and x._auto and len(x._layout.ragged_axes) > 1:  # a reshape's nested runs
        x = _balance(x)
    comm = context.current()
    shape = tuple(x.shape)
    p = x.placement
    coord = p.coord(comm.rank)
    local, sbp = x._local, list(x._layout.sbp)
    have = list(getattr(x, "_sizes", None) or (None,) * p.ndim)
    kept = [a for a in x._layout.ragged_axes if dst.sbp[a] == x._layout.sbp[a] and sizes[a] == have[a]]
    unknown = [a for a in x._layout.ragged_axes if have[a] is None and a not in kept]
    if unknown:
        raise ValueError(f"to_global: mesh axis {unknown[0]} of {x._layout.sbp} is ragged with sizes known only inside "
                         "each slice (gt.by_expert's rows on EP x DP); take them back with gt.by_group")
    for a, s in enumerate(x._layout.sbp):
        if not isinstance(s, Ragged) or (dst.sbp[a] == s and sizes[a] == have[a]):
            continue
        d, want = s.dim, dst.sbp[a]
        if coord is not None:
            group = p.group(comm.rank, a)
            if isinstance(want, Broadcast):
                local = _recut.gather(local, d, have[a], group, comm)
            elif _swaps(x._layout, dst, a):   # rows of d -> a split of another dim: one all-to-all
                local = _recut.swap(local, d, have[a], want.dim, split_sizes(shape[want.dim], p.shape[a]), group, comm)
            else:
                to = sizes[a] if isinstance(want, Ragged) and want.dim == d else split_sizes(shape[d], p.shape[a])
                local = _recut.recut(local, d, have[a], to, group, comm)
        if isinstance(want, Broadcast):
            sbp[a], have[a] = Broadcast(), None
        elif _swaps(x._layout, dst, a):
            sbp[a], have[a] = want, None
        elif isinstance(want, Ragged) and want.dim == d:
            sbp[a], have[a] = want, sizes[a]
        else:
            sbp[a], have[a] = Split(d), None
    now = Layout(p, tuple(sbp))
    if now.ragged_axes and now != dst and _boxes_beside(now, dst):
        if coord is not None:  # every rank of a changing axis' group holds the same rows: box the shards
            rows = [local.shape[now.sbp[a].dim] if a in now.ragged_axes else None for a in range(p.ndim)]
            lshape = tuple(next((r for a, r in enumerate(rows) if r is not None and now.sbp[a].dim == d), n)
                           for d, n in enumerate(shape))
            local = convert_local(local, _balanced(now), _balanced(dst), lshape, comm)
        now = dst
    if now.ragged_axes and any(not isinstance(s, Ragged) and s != t for s, t in zip(now.sbp, dst.sbp)):
        raise ValueError(f"to_global: from {x._layout.sbp} to {dst.sbp}: the axes that stay ragged must be the only "
                         "ragged axes; convert the ragged axes first, then the others")
    if not now.ragged_axes:  # the rest is ordinary boxing, with dst's ragged axes first balanced
        mid = Layout(p, tuple(_entry(s, t, now, dst, a) for a, (s, t) in enumerate(zip(now.sbp, dst.sbp))))
        if mid != now:
            local = convert_local(local, now, mid, shape, comm) if coord is not None else local
        for a in dst.ragged_axes:
            d = dst.sbp[a].dim
            if coord is not None:
                if isinstance(mid.sbp[a], Split) and mid.sbp[a].dim != d:   # a split of another dim -> rows of d
                    e = mid.sbp[a].dim
                    local = _recut.swap(local, e, split_sizes(shape[e], p.shape[a]), d, sizes[a],
                                        p.group(comm.rank, a), comm)
                elif isinstance(mid.sbp[a], Split):
                    local = _recut.recut(local, d, split_sizes(shape[d], p.shape[a]), sizes[a],
                                         p.group(comm.rank, a), comm)
                else:
                    local = _recut.take(local, d, sizes[a], coord[a])
            have[a] = sizes[a]
        now = dst
    return make(local if coord is not None else x._local, now, shape,
                tuple(have) if now.ragged_axes else None)


def boundary_cut(x: GlobalTensor, sbp: tuple, hint: Optional[tuple], arrived: Any) -> tuple:
    """A module boundary's target (`globaltensor/parallel/module.py`): (x, sbp, sizes, unit) for the layout `sbp` (the
    hint over x's own, its None entries kept). A `gt.ragged(d)` entry of the hint takes the cut the module's
    input `arrived` in ((sbp, sizes, unit): its sizes where it was ragged, a balanced split where it was
    split, whole where it was whole); x's own ragged axes keep x's sizes. Where a kept ragged axis would sit in an outer cut that
    changes (the expert axis first on EP x DP), a reshape's runs take the sizes their unit gives that layout;
    anything else takes the balanced splits (x balanced first: rows move). sizes None: not ragged."""
    sizes = list(getattr(x, "sizes", None) or (None,) * len(sbp))
    unit = getattr(x, "_unit", None)
    if hint is not None and any(isinstance(h, Ragged) for h in hint):
        have, have_sizes, unit = arrived if arrived is not None else ((None,) * len(sbp), None, None)
        sbp = list(sbp)
        for a, h in enumerate(hint):
            if not isinstance(h, Ragged):
                continue
            if isinstance(have[a], Ragged) and have_sizes is not None:
                sizes[a] = have_sizes[a]
            elif isinstance(have[a], Split):
                sbp[a] = Split(h.dim)
            elif isinstance(have[a], Broadcast):  # arrived whole: handed back whole (a Partial output reduced)
                sbp[a] = Broadcast()
            else:
                raise ValueError(f"{h!r} on mesh axis {a} takes the cut the module's input arrived in there, but it "
                                 f"arrived {have[a]!r} (not split)")
        sbp = tuple(sbp)
    sizes = tuple(n if isinstance(s, Ragged) else None for s, n in zip(sbp, sizes))
    if not any(n is not None for n in sizes):
        return x, sbp, None, None
    if _one_cut(x.sbp, sbp, hint):
        return x, sbp, sizes, unit
    runs = unit if unit is not None else arrived[2] if arrived is not None else None
    cut = {t.dim for t in sbp if isinstance(t, Ragged)}
    as_runs = tuple(Ragged(t.dim) if type(t) is Split and t.dim in cut else t for t in sbp)
    again = None if runs is None else runs_sizes(Layout(x.placement, as_runs), x.shape, runs)
    if again is not None:
        return x, as_runs, again, runs
    if isinstance(x, RaggedTensor):
        x = x.to_global(x.placement, _balanced_sbp(x._layout))
    return x, tuple(o if h is None else Split(h.dim) if isinstance(h, Ragged) else h
                    for h, o in zip(hint or (None,) * len(sbp), x.sbp)), None, None


def _one_cut(have: tuple, sbp: tuple, hint: Optional[tuple]) -> bool:
    """Whether a ragged target keeps one cut its sizes describe: no split of a dim after a ragged axis of it,
    and each ragged axis kept from the tensor (not named by the hint) inside the same outer cuts as before."""
    for a, s in enumerate(sbp):
        if not isinstance(s, Ragged):
            continue
        if any(isinstance(t, Split) and t.dim == s.dim for t in sbp[a + 1:]):
            return False
        named = hint is not None and hint[a] is not None
        if not named and any(sbp[b] != have[b] and any(isinstance(t, (Split, Ragged)) and t.dim == s.dim
                                                       for t in (sbp[b], have[b])) for b in range(a)):
            return False
    return True


def _boxes_beside(now: Layout, dst: Layout) -> bool:
    """Ragged axes that stay as they are, and other axes whose change cuts no ragged dim (a tensor-parallel
    Partial of ragged rows reduced over the tensor axis): ordinary boxing of the shards, with the ragged
    axes read as Broadcast and the ragged dims at this rank's rows, which its axis group shares."""
    ragged_dims = {now.sbp[a].dim for a in now.ragged_axes}
    return all(s == t if isinstance(s, Ragged) or isinstance(t, Ragged) else
               not (isinstance(t, Split) and t.dim in ragged_dims) for s, t in zip(now.sbp, dst.sbp))


def _entry(src: Any, want: Any, layout: Layout, dst: Layout, axis: int) -> Any:
    """What the boxing before the re-cut must reach on one axis: dst's balanced stand-in for Ragged(d)
    (Split(d), or a split of another dim this axis alone cuts, which one all-to-all swaps for the rows,
    or Broadcast from a Broadcast or Partial source, which then needs only a slice)."""
    if not isinstance(want, Ragged):
        return want
    if isinstance(src, Split) and (src.dim == want.dim or _alone(layout, axis, src.dim) and _alone(dst, axis, src.dim)):
        return src
    return Broadcast()


def _alone(layout: Layout, axis: int, dim: int) -> bool:
    """Whether mesh `axis` is the only one of `layout` that cuts `dim`."""
    return all(a == axis or not isinstance(s, (Split, Ragged)) or s.dim != dim for a, s in enumerate(layout.sbp))


def _axis_sizes(layout: Layout, shape: tuple, sizes: Sizes, unit: Optional[int], rank: int, axis: int) -> tuple:
    """The sizes `axis` cuts its dim in for `rank`'s group: a balanced split's (the axis alone on its dim), a
    reshape's runs' from their unit (nested runs differ between groups), else the tensor's own."""
    s = layout.sbp[axis]
    if type(s) is Split:
        return tuple(split_sizes(shape[s.dim], layout.placement.shape[axis]))
    if unit is not None and runs_sizes(layout, shape, unit) == sizes:
        return runs_sizes(layout, shape, unit, rank)[axis]
    return sizes[axis]


def _inner_swap(src: Layout, src_sizes: Sizes, dst: Layout, dst_sizes: Sizes, shape: tuple) -> Optional[int]:
    """The one mesh axis on which src and dst differ, where one side holds rows of d on it (the innermost
    of that side's ragged axes: nested runs stay runs of the same outer pieces) and the other a balanced
    split of another dim that no other axis cuts; every other axis (and its sizes) alike. None otherwise."""
    if src.placement != dst.placement or any(src_sizes is None or src_sizes[a] is None for a in src.ragged_axes) or \
            any(dst_sizes is None or dst_sizes[a] is None for a in dst.ragged_axes):
        return None   # sizes known inside each slice only (by_expert's rows on EP x DP): not re-cut here
    src_cuts, dst_cuts = _cuts(src, shape, src_sizes), _cuts(dst, shape, dst_sizes)
    differ = [a for a in range(src.placement.ndim) if src_cuts[a] != dst_cuts[a]]
    if len(differ) != 1:
        return None
    (a,) = differ
    s, t = src.sbp[a], dst.sbp[a]
    for rows, cut, side in ((s, t, src), (t, s, dst)):
        if isinstance(rows, Ragged) and type(cut) is Split and cut.dim != rows.dim and a == max(side.ragged_axes) \
                and _alone(src, a, cut.dim) and _alone(dst, a, cut.dim):
            return a
    return None


def _swaps(src: Layout, dst: Layout, axis: int) -> bool:
    """Whether `axis` goes from rows of one dim to a balanced split of another that no other axis cuts,
    in either layout: one all-to-all (`boxing/ragged.py`'s swap)."""
    s, t = src.sbp[axis], dst.sbp[axis]
    return isinstance(s, Ragged) and type(t) is Split and t.dim != s.dim and _alone(src, axis, t.dim) and \
        _alone(dst, axis, t.dim)


class _Convert(torch.autograd.Function):
    """The gradient goes back the reverse way: into the source's (dual) layout and sizes."""

    @staticmethod
    def forward(ctx, x: GlobalTensor, dst: Layout, sizes: Sizes, unit: Optional[int] = None) -> GlobalTensor:  # type: ignore[override]
        ctx.src, ctx.sizes = grad_layout(x._layout), getattr(x, "_sizes", None)
        ctx.unit = getattr(x, "_unit", None)
        return _convert_now(x, dst, sizes, unit)

    @staticmethod
    def backward(ctx, grad: GlobalTensor):  # type: ignore[override]
        unit = ctx.unit if ctx.unit is not None else getattr(grad, "_unit", None)   # the runs either side is cut in
        if ctx.unit is not None and len(ctx.src.ragged_axes) > 1 and \
                _inner_swap(grad._layout, getattr(grad, "_sizes", None), ctx.src, ctx.sizes, tuple(grad.shape)) is None \
                and not _runs_of(grad, ctx.unit):
            # a reshape's nested runs: by way of the balanced split
            balanced = _convert_now(grad, Layout(ctx.src.placement, _balanced_sbp(ctx.src)), None)
            return _unbalance(RaggedTensor, balanced, ctx.src, ctx.unit), None, None, None
        out = _convert_now(grad, ctx.src, ctx.sizes, unit)
        if ctx.unit is not None and isinstance(out, RaggedTensor):
            out._unit = ctx.unit   # still a reshape's runs: ops that do not keep them balance them
        return out, None, None, None


class FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout, shape: tuple, sizes: Sizes) -> GlobalTensor:  # type: ignore[override]
        ctx.layout, ctx.sizes = grad_layout(layout), sizes
        return make(local.view_as(local), layout, shape, sizes)

    @staticmethod
    def backward(ctx, grad: GlobalTensor):  # type: ignore[override]
        if grad._layout != ctx.layout or getattr(grad, "_sizes", None) != ctx.sizes:
            grad = _convert_now(grad, ctx.layout, ctx.sizes)
        return grad._local, None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: RaggedTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.layout, ctx.shape, ctx.sizes = grad_layout(x._layout), tuple(x.shape), x._sizes
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return make(grad, ctx.layout, ctx.shape, ctx.sizes)


# -- a reshape's runs: exchanged point to point, balanced and back ----------------------------------
def _runs_of(x: GlobalTensor, unit: int) -> bool:
    """Whether x is balanced (no Partial) or a reshape's runs in units of `unit`: every rank's block is known."""
    if isinstance(x, RaggedTensor):
        return x._unit == unit and _runs_of_layout(x._layout, x._sizes, tuple(x.shape), unit)
    return not x._layout.has_partial


def _exchange_runs(x: GlobalTensor, dst: Layout, sizes: Sizes, unit: int) -> GlobalTensor:
    """x (balanced, or a reshape's runs) in `dst` (the same unit's runs, or balanced), where several mesh axes
    change at once (the expert axis first on EP x DP: nested runs -> experts split and the runs re-cut over
    the other axis): every rank's block on both sides follows from the structure, so each receives exactly
    what its target block holds and its source block does not, point to point, from the rank that holds it
    alike on the source's Broadcast axes."""
    comm = context.current()
    p, shape, rank = x.placement, tuple(x.shape), comm.rank
    src, out = x._layout, dst
    if p.coord(rank) is None:
        return make(x._local, dst, shape, sizes if dst.ragged_axes else None)
    whole = [a for a, s in enumerate(src.sbp) if isinstance(s, Broadcast)]

    def alike(q: int) -> bool:
        return all(p.coord(q)[a] == p.coord(rank)[a] for a in whole)
    mine, want = _box_at(src, shape, unit, rank), _box_at(out, shape, unit, rank)
    sends, recvs, pieces = {}, {}, []
    for q in p.flat_ranks:
        if q == rank:
            continue
        if alike(q):
            give = intersect(mine, _box_at(out, shape, unit, q))
            if numel(give):
                sends[q] = slice_box(x._local, relative(give, mine)).contiguous()
            take = intersect(_box_at(src, shape, unit, q), want)
            if numel(take):
                recvs[q] = (tuple(n for _, n in take), x._local.dtype)
                pieces.append((q, take))
    local = x._local.new_empty(tuple(n for _, n in want))
    own = intersect(mine, want)
    if numel(own):
        slice_box(local, relative(own, want)).copy_(slice_box(x._local, relative(own, mine)))
    key = zlib.crc32(repr((src, dst, shape, "runs")).encode()) or 1
    got = comm.exchange(sends, recvs, None, x._local.device, key)
    for q, box in pieces:
        slice_box(local, relative(box, want)).copy_(got[q])
    return make(local, dst, shape, sizes if dst.ragged_axes else None)
