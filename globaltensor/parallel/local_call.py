"""A module run on its local tensors: its parameters and buffers swapped for plain tensors while its
class's forward runs, put back after.

Why one place: plain regions (`plain.py`), their shape check, one-rank pipeline stages (`stage.py`) and
a replayed tape (`replay.py`) all run a module's own forward in plain torch; they differ only in which
plain tensor each slot holds meanwhile (a shard, a step's plain leaf, a stand-in of a rank's shapes),
which the caller passes, and in how they make the inputs plain and wrap the outputs, which stay theirs.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from ..tensor import GlobalTensor


class Swap(NamedTuple):
    """One parameter or buffer slot: `table[name]` holds `plain` while the forward runs (a plain tensor; for a
    row-local module's row group, its sub-mesh GlobalTensor), `tensor` before and after; `plain` None:
    `tensor.to_local()`, made at each call (a differentiable one, a new autograd node)."""
    table: dict
    name: str
    tensor: GlobalTensor
    plain: Optional[torch.Tensor]


def call_local(module: torch.nn.Module, swaps: Sequence[Swap], args: tuple, kwargs: dict) -> Any:
    """`type(module).forward` on `args`, `kwargs` (already plain: the caller's) with `swaps` in place; the
    slots hold their tensors again when it returns or raises. The class's forward, not `module.forward`:
    a plain region or stage is installed as the latter and would call itself."""
    for table, name, t, plain in swaps:
        table[name] = t.to_local() if plain is None else plain
    try:
        return type(module).forward(module, *args, **kwargs)
    finally:
        for table, name, t, _ in swaps:
            table[name] = t
