"""as_strided and its kin (as_strided_, as_strided_copy, as_strided_scatter): one device's storage, read exactly.

On one device as_strided reads the tensor's storage at `offset + sum(i_k * stride_k)`, whatever the tensor's
own sizes say. A global tensor has no storage beside its shards, but its wrapper carries the strides and
storage offset one device's tensor would have (`keys.geometry_of`: `x.t()` is `(1, n)`, `x[1:]` starts at
`n`), so each of its elements has a storage position. Where every position as_strided reads is one of the
tensor's own, the result is those elements, gathered in its order (`torch.take` of the row-major indices):
exact for any layout. A position outside them (a slice's neighbours, the rest of a base) holds what the
global tensor does not have, so the call raises, naming the fix, rather than read something else.

A Broadcast tensor whose shard has the wrapper's very strides and offset is viewed in place, as on one
device, so writes through the result reach the tensor (autograd's as_strided backward writes its gradient
through such a view of a fresh buffer). Elsewhere the result is a gathered copy: writing into it raises
(`program.refuse_cut`), since the write would not reach the tensor it was read from.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch

from ..sbp import Broadcast
from .keys import geometry_of, meta_of
from .program import restate
from .registry import Rule, aten, no_signatures, register


def _positions(shape: Sequence[int], stride: Sequence[int], offset: int) -> torch.Tensor:
    """The storage position of every element, in row-major order (int64)."""
    pos = torch.full((), offset, dtype=torch.int64)
    for n, s in zip(shape, stride):
        pos = pos.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    return pos.reshape(-1)


@functools.lru_cache(maxsize=256)
def _lookup(shape: tuple, stride: tuple, offset: int, size: tuple, new_stride: tuple,
            new_offset: int) -> Optional[torch.Tensor]:
    """The row-major index into the tensor (shape, stride, offset) of each element the geometry
    (size, new_stride, new_offset) reads, or None where one of them sits at no element of the tensor.
    Where elements share a position (an expanded dim) any of them will do: they are one value."""
    want = _positions(size, new_stride, new_offset)
    if want.numel() == 0:
        return want
    have = _positions(shape, stride, offset)
    if have.numel() == 0:
        return None
    lo, hi = int(have.min()), int(have.max())
    if int(want.min()) < lo or int(want.max()) > hi:
        return None
    table = torch.full((hi - lo + 1,), -1, dtype=torch.int64)
    table[have - lo] = torch.arange(have.numel(), dtype=torch.int64)
    index = table[want - lo]
    return None if bool((index < 0).any()) else index


def _torch_checks(x: Any, size: list, stride: list, offset: int) -> None:
    """torch's own argument checks (lengths that differ, negative strides or offset) on a meta storage
    large enough that only they can fail."""
    need = 1 + offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 1
    torch.empty((max(need, 1),), dtype=x.dtype, device="meta").as_strided(size, stride, offset)


def _geometry(x: Any, size: Any, stride: Any, offset: Any) -> tuple:
    size, stride = [int(s) for s in size], [int(s) for s in stride]
    return size, stride, x.storage_offset() if offset is None else int(offset)


def _index(op: str, x: Any, size: list, stride: list, offset: int) -> torch.Tensor:
    """The row-major indices of the elements read, or a clear error where one is not the tensor's."""
    if x._layout.ragged_axes:
        raise NotImplementedError(f"{op}: a ragged tensor's rows are data, not a storage with strides; "
                                  "re-cut it to a balanced split (x.to_global(sbp=gt.split(d))) first")
    index = _lookup(tuple(x.shape), tuple(x.stride()), x.storage_offset(), tuple(size), tuple(stride), offset)
    if index is None:
        raise NotImplementedError(
            f"{op}: as_strided(size={size}, stride={stride}, storage_offset={offset}) reads storage positions "
            f"where none of the tensor's elements sit (its sizes {tuple(x.shape)}, strides {tuple(x.stride())}, "
            f"storage offset {x.storage_offset()}): on one device they hold the rest of its storage (a slice's "
            "neighbours, its base's other elements), which a global tensor does not have. Call .contiguous() "
            "first, so that the storage is the tensor's own elements in row-major order, and address those")
    return index


def strided(op: str, x: Any, size: Any, stride: Any, offset: Any) -> Any:
    """`x.as_strided(size, stride, offset)` as one device computes it (see the module docstring)."""
    size, stride, offset = _geometry(x, size, stride, offset)
    _torch_checks(x, size, stride, offset)
    index = _index(op, x, size, stride, offset)
    layout, local = x._layout, x._local
    if all(isinstance(s, Broadcast) for s in layout.sbp) and tuple(local.shape) == tuple(x.shape) and \
            local.stride() == x.stride() and local.storage_offset() == x.storage_offset():
        view = local.as_strided(size, stride, offset)  # the shard is one device's tensor: a true view
        return type(x)._wrapper(layout, size, x.dtype, geometry_of(size, stride, offset))(view)
    out = aten.view.default(aten.take.default(x, index.to(local.device)), size)
    out = type(out)._wrapper(out._layout, size, out.dtype, geometry_of(size, stride, offset))(out._local)
    out._cut_from = op  # a gathered copy: a write into it would not reach x
    return out


def _args(func: Any, args: tuple, kwargs: dict) -> list:
    """The op's arguments in schema order, keywords included (None where left out)."""
    return [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(func._schema.arguments)]


def as_strided(func: Any, args: tuple, kwargs: dict) -> Any:
    x, size, stride, offset = _args(func, args, kwargs)
    return strided(str(func), x, size, stride, offset)


def as_strided_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """as_strided's elements in fresh contiguous memory, as torch's as_strided_copy returns them."""
    return aten.clone.default(as_strided(func, args, kwargs), memory_format=torch.contiguous_format)


def as_strided_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    """The target takes as_strided's result as its shard and layout, and the op's sizes, strides and offset on
    its wrapper (`program.restate`); where that result is a gathered copy the target no longer shares memory
    with the tensors it did, so writes into it raise (`program.refuse_cut`) rather than not reach them."""
    target = args[0]
    out = as_strided(func, args, kwargs)
    restate(target, func, args, kwargs, out._local, out._layout)
    cut = getattr(out, "_cut_from", None)
    if cut is not None:
        target._cut_from = cut
    return target


def as_strided_scatter(func: Any, args: tuple, kwargs: dict) -> Any:
    """`self.clone()` with `src` written where `clone.as_strided(size, stride, offset)` reads, as torch's kernel
    does it: positions are the clone's (torch's strides for a clone of self, offset 0), and every position of
    a clone is one of its elements, so only a geometry torch itself refuses fails."""
    self, src, size, stride, offset = _args(func, args, kwargs)
    if self.requires_grad and not self.is_contiguous():  # torch's kernel refuses this too (its backward's limit)
        raise RuntimeError(f"{func}: as_strided_scatter is currently only supported for contiguous inputs "
                           "that require grad (as torch's); call .contiguous() first")
    func(meta_of(self), meta_of(src), size, stride, offset)  # torch's checks (sizes, bounds), on meta
    out = aten.clone.default(self)
    size, stride, offset = _geometry(out, size, stride, offset)
    index = _index(str(func), out, size, stride, offset)
    if index.unique().numel() != index.numel():
        raise RuntimeError(f"{func}: unsupported operation: more than one element of the written-to tensor "
                           "refers to a single memory location (the strides overlap)")
    return aten.put_.default(out, index.to(out._local.device), src)


register([aten.as_strided.default], Rule(no_signatures, decompose=as_strided))
register([aten.as_strided_copy.default], Rule(no_signatures, decompose=as_strided_copy))
register([aten.as_strided_.default], Rule(no_signatures, decompose=as_strided_in_place))
register([aten.as_strided_scatter.default], Rule(no_signatures, decompose=as_strided_scatter))
