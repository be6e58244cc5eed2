"""The front door: creating global tensors from full tensors or from local shards."""
from __future__ import annotations

from typing import Any, Sequence, TypeVar, overload

import torch

from .layout import Layout, normalize_sbp
from .parallel.module import PlanLike, module_to_global
from .placement import Placement
from .runtime import context
from .sbp import SbpLike, Split, Strided, Zigzag
from .raggedtensor import ops as _ragged
from .tensor import GlobalTensor, FromLocal, device_for, distribute


M = TypeVar("M", bound=torch.nn.Module)


def _check_placement(placement: Any, fn: str) -> Placement:
    if not isinstance(placement, Placement):
        raise TypeError(f"{fn}(placement): expected gt.placement(device_type, ranks), got {type(placement).__name__}")
    placement.check_world(context.current().world_size)
    return placement


@overload
def to_global(obj: torch.Tensor, placement: Placement, sbp: SbpLike, grad_sbp: SbpLike | None = None,
              sizes: Sequence[int] | None = None) -> GlobalTensor: ...


@overload
def to_global(obj: M, placement: Placement, sbp: PlanLike | None = None) -> M: ...


def to_global(obj: torch.Tensor | torch.nn.Module, placement: Placement, sbp: SbpLike | PlanLike | None = None,
              grad_sbp: SbpLike | None = None, sizes: Sequence[int] | None = None) -> GlobalTensor | torch.nn.Module:
    """Lay out a full tensor (the same on every rank) as `sbp` over `placement`; no communication.

    A GlobalTensor is boxed instead (`GlobalTensor.to_global`, where `grad_sbp` is explained);
    a module is converted in place (and returned) by the plan passed as `sbp` (a `PlanLike`;
    `globaltensor.parallel.module`).

    Like DTensor's `distribute_tensor`, the result is a leaf that keeps `requires_grad`; its
    shard is a copy, so in-place ops on it never reach `t` (or, simulated, another rank).
    A Partial(sum) axis puts the value on its first rank and zeros on the others;
    Partial(max/min) keeps the value everywhere.

    `sizes` goes with a ragged sbp (`gt.ragged(d)`): each rank's rows of d, one int per rank of the
    ragged mesh axis; a GlobalTensor is then re-cut with one uneven all-to-all (`globaltensor/raggedtensor/ops.py`).
    """
    if isinstance(obj, _ragged.RaggedTensor):
        return obj.to_global(placement, sbp, grad_sbp, sizes)
    if isinstance(obj, GlobalTensor):
        if sizes is None:
            return obj.to_global(placement, sbp, grad_sbp)
        if grad_sbp is not None or placement != obj.placement:
            raise ValueError("to_global(sizes): a conversion to a ragged layout stays on the tensor's placement "
                             "and takes no grad_sbp")
        return _ragged.convert(obj, Layout(placement, normalize_sbp(sbp, placement.ndim)), sizes)
    if grad_sbp is not None:
        raise ValueError("to_global(grad_sbp): only a GlobalTensor's conversion has a gradient to lay out; "
                         "a full tensor or module becomes a leaf (drop grad_sbp)")
    if isinstance(obj, torch.nn.Module):
        return module_to_global(obj, _check_placement(placement, "to_global"), sbp)
    if sbp is None:
        raise TypeError("to_global(sbp): required for a tensor (gt.split(d), gt.broadcast, gt.partial_sum "
                        "or a tuple of them, one per mesh axis)")
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"to_global(tensor): expected a torch.Tensor or GlobalTensor, got {type(obj).__name__}")
    placement = _check_placement(placement, "to_global")
    layout = Layout(placement, normalize_sbp(sbp, placement.ndim))
    layout.check_shape(obj.shape)
    if sizes is not None or layout.ragged_axes:
        return _ragged.distribute(obj, layout, sizes, requires_grad=obj.requires_grad)
    return distribute(obj, layout, requires_grad=obj.requires_grad)


def _check_shape_arg(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise TypeError(f"from_local(shape): expected a tuple of non-negative ints, got {shape!r}")
    return tuple(shape)


def _discover_shape(local: torch.Tensor, layout: Layout) -> tuple[int, ...]:
    """One small collective over the world: every rank learns every shard's shape."""
    comm = context.current()
    p = layout.placement
    inside = p.coord(comm.rank) is not None
    shapes = comm.all_gather_object(tuple(local.shape) if inside else None, tuple(range(comm.world_size)))
    by_rank = {r: shapes[r] for r in p.flat_ranks}
    ndims = {len(s) for s in by_rank.values()}
    if len(ndims) != 1:
        raise ValueError(f"from_local(local): shards have different numbers of dims: {by_rank}")
    ndim = ndims.pop()
    layout.check_shape((0,) * ndim, "from_local(sbp)")
    shape = []
    for d in range(ndim):
        axes = {a for a, s in enumerate(layout.sbp) if isinstance(s, (Split, Zigzag, Strided)) and s.dim == d}
        shape.append(sum(by_rank[r][d] for r in p.flat_ranks
                         if all(c == 0 for a, c in enumerate(p.coord(r)) if a not in axes)))
    bad = {r: s for r, s in by_rank.items() if layout.local_shape(shape, r) != s}
    if bad and not any(isinstance(s, (Split, Zigzag, Strided)) for s in layout.sbp):
        held: dict = {}
        for r, s in by_rank.items():
            held.setdefault(s, []).append(r)
        raise ValueError(f"from_local(local): with sbp {layout.sbp} every rank holds the whole tensor, so every "
                         "rank's local must have one shape, but " +
                         "; ".join(f"ranks {rs} hold {s}" for s, rs in held.items()) +
                         " (a tensor whose size depends on the rank is a split: use gt.split(d))")
    if bad:
        raise ValueError(f"from_local(local): shard shapes {by_rank} are not the array_split shards of any "
                         f"global shape under sbp {layout.sbp} (ranks {sorted(bad)} disagree with {tuple(shape)})")
    return tuple(shape)


def from_local(local: torch.Tensor, placement: Placement, sbp: SbpLike,
               shape: Sequence[int] | None = None, sizes: Sequence[int] | None = None) -> GlobalTensor:
    """Build a GlobalTensor from each rank's shard (differentiable).

    Without `shape`, the ranks exchange their shards' shapes with one small collective:
    a split layout learns its global shape (uneven shards just work) and ranks whose
    shards do not fit one global shape (Broadcast locals of different shapes) fail,
    named. With `shape`, each rank checks its own shard against it and nothing is exchanged.

    A ragged sbp (`gt.ragged(d)`) takes `sizes`, each rank's rows of d (one int per rank of the
    ragged mesh axis); one small all-gather checks that they add up to the shards' rows and that every
    rank gives the same sizes, with or without `shape`.
    """
    if isinstance(local, GlobalTensor) or not isinstance(local, torch.Tensor):
        raise TypeError(f"from_local(local): expected a plain torch.Tensor shard, got {type(local).__name__}")
    placement = _check_placement(placement, "from_local")
    layout = Layout(placement, normalize_sbp(sbp, placement.ndim))
    if sizes is not None or layout.ragged_axes:
        if sizes is None:
            _ragged.check_sizes(None, layout, None, "from_local(sizes)")  # raises, naming sizes
        return _ragged.from_local(local, layout, sizes, None if shape is None else _check_shape_arg(shape))
    comm = context.current()
    inside = placement.coord(comm.rank) is not None
    if shape is None:  # shapes are exchanged even without a split: ranks that disagree fail here, not later
        shape = _discover_shape(local, layout)
    else:
        shape = _check_shape_arg(shape)
        layout.check_shape(shape, "from_local(sbp)")
        if inside and tuple(local.shape) != layout.local_shape(shape, comm.rank):
            raise ValueError(f"from_local(shape): rank {comm.rank} should hold a shard of shape "
                             f"{layout.local_shape(shape, comm.rank)} of the global {tuple(shape)} under "
                             f"{layout.sbp}, but local has shape {tuple(local.shape)}")
    layout.check_shape(shape, "from_local(sbp)")
    if not inside:
        local = local.reshape(-1)[:0]  # keeps requires_grad: this rank still joins the backward boxing
    # a lazy conjugate or negation (`z.conj()`) is a flag on the shard that the kernels under __torch_dispatch__
    # do not honour: resolved here (free where no flag is set), or later ops would read the unconjugated values
    local = local.resolve_conj().resolve_neg().to(device_for(placement))
    return FromLocal.apply(local, layout, tuple(shape))
