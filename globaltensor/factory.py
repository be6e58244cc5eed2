"""gt.randn/rand/zeros/ones/empty: global tensors made where they live, values independent of the layout."""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from .layout import Layout, normalize_sbp
from .placement import Placement
from .runtime import context
from .sbp import Partial, SbpLike
from .tensor import GlobalTensor, device_for, distribute


def _shape(shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise TypeError(f"shape: expected non-negative ints, got {shape!r}")
    return tuple(shape)


def _make(fill: Callable[[tuple, dict], torch.Tensor], random: bool, shape: tuple, placement: Placement,
          sbp: SbpLike, dtype: torch.dtype | None, requires_grad: bool) -> GlobalTensor:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement: expected a gt.placement, got {type(placement).__name__}")
    shape = _shape(shape)
    layout = Layout(placement, normalize_sbp(sbp, placement.ndim))
    layout.check_shape(shape)
    comm = context.current()
    opts = {"dtype": dtype or torch.get_default_dtype(), "device": device_for(placement)}
    if random:  # every rank draws the global tensor (same generator state as one device), keeps its shard
        return distribute(fill(shape, opts), layout, requires_grad)
    coord = placement.coord(comm.rank)  # None outside the placement
    local = fill(layout.local_shape(shape, comm.rank) if coord is not None else (0,), opts)
    if coord is not None and any(isinstance(s, Partial) and s.op == "sum" and coord[a] != 0
                               for a, s in enumerate(layout.sbp)):
        local = torch.zeros_like(local)
    return GlobalTensor(local, layout, shape, requires_grad=requires_grad)


class Factory(Protocol):
    """The signature the five factories share: a shape as torch takes it, then where and how it lives."""

    def __call__(self, *shape: int | Sequence[int], placement: Placement, sbp: SbpLike,
                 dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor: ...


def _factory(name: str, fill: Callable, random: bool, doc: str) -> Factory:
    def make(*shape: int | Sequence[int], placement: Placement, sbp: SbpLike, dtype: torch.dtype | None = None,
             requires_grad: bool = False) -> GlobalTensor:
        return _make(fill, random, shape, placement, sbp, dtype, requires_grad)
    make.__name__ = make.__qualname__ = name
    make.__doc__ = doc
    return make


_RANDOM = ("Every rank draws the whole tensor from its generator and keeps its shard, so the values equal one "
           "device's with the same seed whatever the layout.")
randn = _factory("randn", lambda s, o: torch.randn(s, **o), True,
                 f"`torch.randn(*shape)` laid out as `sbp` over `placement`. {_RANDOM}")
rand = _factory("rand", lambda s, o: torch.rand(s, **o), True,
                f"`torch.rand(*shape)` laid out as `sbp` over `placement`. {_RANDOM}")
zeros = _factory("zeros", lambda s, o: torch.zeros(s, **o), False,
                 "`torch.zeros(*shape)` laid out as `sbp` over `placement`; each rank allocates its shard only.")
ones = _factory("ones", lambda s, o: torch.ones(s, **o), False,
                "`torch.ones(*shape)` laid out as `sbp` over `placement`; each rank allocates its shard only "
                "(a Partial(sum) axis: ones on its first rank, zeros on the others, so the sum is ones).")
empty = _factory("empty", lambda s, o: torch.empty(s, **o), False,
                 "`torch.empty(*shape)` laid out as `sbp` over `placement`: uninitialised shards, allocated where "
                 "they live.")
