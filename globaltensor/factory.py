"""gt.randn/rand/zeros/ones/empty: global tensors made where they live, values independent of the layout."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .layout import Layout, normalize_sbp
from .placement import Placement
from .runtime import context
from .sbp import Partial
from .tensor import GlobalTensor, device_for, distribute


def _shape(shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise TypeError(f"shape: expected non-negative ints, got {shape!r}")
    return tuple(shape)


def _make(fill: Callable[[tuple, dict], torch.Tensor], random: bool, shape: tuple, placement: Placement,
          sbp: Any, dtype: Any, requires_grad: bool) -> GlobalTensor:
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


def _factory(fill: Callable, random: bool):
    def make(*shape: int, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
             requires_grad: bool = False) -> GlobalTensor:
        return _make(fill, random, shape, placement, sbp, dtype, requires_grad)
    return make


randn = _factory(lambda s, o: torch.randn(s, **o), True)
rand = _factory(lambda s, o: torch.rand(s, **o), True)
zeros = _factory(lambda s, o: torch.zeros(s, **o), False)
ones = _factory(lambda s, o: torch.ones(s, **o), False)
empty = _factory(lambda s, o: torch.empty(s, **o), False)
