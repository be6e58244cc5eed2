"""An op run on a reading of its operands: the one skeleton of the zigzag and strided layouts.

Both layouts hold what `Split(d)` holds of the tensor with d's rows permuted, so an op for which that
permutation permutes one dim of every operand and result alike (`zigzag_dims.py`'s table) runs through
the dispatcher on the reading: each operand read (`read`), the op dispatched, each result read back
(`back`). What differs between the layouts is only how an operand is read and a result put back.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .decide import flatten_out, map_tensors
from .dispatch import run as dispatch
from .registry import is_inplace


def on_reading(func: Any, args: tuple, kwargs: dict, plain: type, read: Callable[[Any, int], Optional[Any]],
               out_dims: Callable[[list], list], back: Callable[[Any, int], Any]) -> Optional[Any]:
    """`func` on the reading: `read(t, i)` gives operand i on it (None: it cannot be read so, and the call
    is not run here: None), `out_dims(results)` each result's permuted dim (None: it has none) and
    `back(result, dim)` a result holding more than one row of its dim as the tensor it stands for."""
    failed = []

    def each(t: Any, i: int) -> Any:
        r = read(t, i)
        if r is None:
            failed.append(t)
            return t
        return r
    new_args, new_kwargs = map_tensors(args, kwargs, each)
    if failed:
        return None
    out = dispatch(func, new_args, new_kwargs, plain)
    if is_inplace(func):  # the op wrote the reading of args[0], which shares or replaces its shard
        if new_args[0]._local is not args[0]._local:
            args[0]._local = new_args[0]._local
        return args[0]
    outs, put_back = flatten_out(out)
    return put_back([back(o, d) if isinstance(o, torch.Tensor) and d is not None and d < o.ndim and o.shape[d] > 1
                     else o for o, d in zip(outs, out_dims(outs))])
