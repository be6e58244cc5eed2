"""What a dispatch decision depends on, as one hashable key per call.

A decision (signature, boxing, output layouts) depends on each GlobalTensor
argument's (layout, shape, dtype), on plain tensors' shape and dtype, on the
call's structure (which positions and list slots hold tensors) and on its
ints, bools, strings and dtypes. Floats are different: an optimizer passes a
new learning rate or bias correction every step, and keying on them would
make every step a cache miss. So a float keys only as "a float", unless the
op has no rule (torch's meta kernel then decides, and a float may set a
shape: `upsample(scale_factors=)`) or its rule names what it reads of its
scalars (`Rule.scalar_key`: masked_fill's "is the fill zero").
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from ..layout import Layout


class TensorKey:
    """One GlobalTensor's (layout, shape, dtype, geometry), interned: hashed and compared by identity.

    So a cache-hit key is a tuple of such objects that hashes without looking
    inside layouts or shapes. Every GlobalTensor carries its own as `_key`.
    Interning is weak: a key no tensor and no cached decision holds is freed,
    so a loop whose shapes change every step does not grow the table.

    `geometry` is the (strides, storage offset) its wrapper carries, as one device's tensor would have
    them after the same ops (`x.t().stride()` is `(1, n)`), or None for the contiguous strides at offset
    0, which most tensors have. It is part of the key because an op's output strides follow its inputs'
    (a pointwise op keeps a transposed layout) and because a few ops read them (as_strided, a view's
    legality): a decision made for a contiguous input must not serve a transposed one.
    """
    __slots__ = ("layout", "shape", "dtype", "geometry", "__weakref__")

    def __copy__(self) -> "TensorKey":
        return self

    def __deepcopy__(self, memo: dict) -> "TensorKey":
        return self

    def __reduce__(self):
        return (tensor_key, (self.layout, self.shape, self.dtype, self.geometry))

    def __repr__(self) -> str:
        at = "" if self.geometry is None else f", strides {self.geometry[0]} at {self.geometry[1]}"
        return f"TensorKey({self.layout}, {self.shape}, {self.dtype}{at})"


_TENSOR_KEYS: "weakref.WeakValueDictionary[tuple, TensorKey]" = weakref.WeakValueDictionary()


def tensor_key(layout: Layout, shape: tuple, dtype: torch.dtype, geometry: Optional[tuple] = None) -> TensorKey:
    """The interned key; `geometry` as `geometry_of` gives it (None: contiguous at offset 0)."""
    k = (layout, shape, dtype, geometry)
    key = _TENSOR_KEYS.get(k)
    if key is None:
        key = TensorKey()
        key.layout, key.shape, key.dtype, key.geometry = k
        _TENSOR_KEYS[k] = key
    return key


def contiguous_strides(shape: Sequence[int]) -> tuple:
    """The strides torch gives a new tensor of `shape` (size-1 and size-0 dims included)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def geometry_of(shape: Sequence[int], stride: Sequence[int], offset: int) -> Optional[tuple]:
    """A wrapper's (strides, storage offset) as a key holds it: None where they are a new tensor's."""
    stride = tuple(stride)
    if offset == 0 and stride == contiguous_strides(shape):
        return None
    return stride, int(offset)


def meta_of(t: torch.Tensor) -> torch.Tensor:
    """A meta stand-in of `t` with its sizes, strides and storage offset, so that an op's meta kernel gives the
    output strides one device gives (and raises where one device raises: `.view` of a transposed tensor)."""
    shape = tuple(t.shape)
    if t.layout is not torch.strided:  # sparse and other layouts have no strides: a dense stand-in, as before
        return torch.empty(shape, dtype=t.dtype, device="meta")
    stride, offset = t.stride(), t.storage_offset()
    if offset == 0 and stride == contiguous_strides(shape):
        return torch.empty(shape, dtype=t.dtype, device="meta")
    extent = offset + (1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0)
    return torch.empty((extent,), dtype=t.dtype, device="meta").as_strided(shape, stride, offset)


_PLAIN = object()  # marks a plain tensor's (shape, dtype) in a key
_FLOAT = object()  # a float whose value the decision does not read
_END = object()    # closes a list or tuple


def call_key(func: Any, args: tuple, kwargs: Optional[dict], cls: type,
             scalar_key: Optional[Callable[[tuple, dict], Any]], floats_by_value: bool) -> tuple:
    """The decision key of `func(*args, **kwargs)`; see the module docstring for what enters it."""
    key: list = [id(func)]  # ops live as long as torch: their ids hash in C, OpOverload.__hash__ in Python
    for a in args:
        t = type(a)
        if t is cls:
            key.append(a._key)
        elif t is int or t is bool:
            key.append(a)
        else:
            _add(key, a, cls, floats_by_value)
    if kwargs:
        for k, v in kwargs.items():
            key.append(k)
            _add(key, v, cls, floats_by_value)
    if scalar_key is not None:
        key.append(scalar_key(args, kwargs or {}))
    return tuple(key)


def _add(key: list, a: Any, cls: type, floats_by_value: bool) -> None:
    t = type(a)
    if t is cls:
        key.append(a._key)
    elif t is float:
        key.append(a if floats_by_value else _FLOAT)
    elif t is list or t is tuple:
        for e in a:
            if type(e) is not int:
                break
        else:  # ints only (a view's shape, a dim list): one entry, no walk
            key.append((t, *a))
            return
        key.append(t)
        for e in a:
            _add(key, e, cls, floats_by_value)
        key.append(_END)
    elif isinstance(a, cls):
        key.append(a._key)
    elif isinstance(a, torch.Tensor):  # its strides too: an output's strides follow every input's
        key += (_PLAIN, a.shape, a.stride() if a.layout is torch.strided else a.layout, a.dtype, a.device)
    else:
        key.append(a)
