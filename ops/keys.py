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
from typing import Any, Callable, Optional

import torch

from ..layout import Layout


class TensorKey:
    """One GlobalTensor's (layout, shape, dtype), interned: hashed and compared by identity.

    So a cache-hit key is a tuple of such objects that hashes without looking
    inside layouts or shapes. Every GlobalTensor carries its own as `_key`.
    Interning is weak: a key no tensor and no cached decision holds is freed,
    so a loop whose shapes change every step does not grow the table.
    """
    __slots__ = ("layout", "shape", "dtype", "__weakref__")

    def __copy__(self) -> "TensorKey":
        return self

    def __deepcopy__(self, memo: dict) -> "TensorKey":
        return self

    def __reduce__(self):
        return (tensor_key, (self.layout, self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"TensorKey({self.layout}, {self.shape}, {self.dtype})"


_TENSOR_KEYS: "weakref.WeakValueDictionary[tuple, TensorKey]" = weakref.WeakValueDictionary()


def tensor_key(layout: Layout, shape: tuple, dtype: torch.dtype) -> TensorKey:
    k = (layout, shape, dtype)
    key = _TENSOR_KEYS.get(k)
    if key is None:
        key = TensorKey()
        key.layout, key.shape, key.dtype = k
        _TENSOR_KEYS[k] = key
    return key


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
    elif isinstance(a, torch.Tensor):
        key += (_PLAIN, a.shape, a.dtype, a.device)
    else:
        key.append(a)
