"""In-place ops that change their target's shape or strides, not its values: squeeze_, unsqueeze_,
transpose_, t_ (torch's in-place views), resize_, resize_as_, and addbmm_ of a target that broadcasts.

Each is its out-of-place view twin, dispatched (so the split travels as `ops/view.py` says, boxing only
where the view's rule must), whose shard and layout the target then takes, with the op's own sizes and
strides on its wrapper (`program.restate`). Run as the view twin, the target's new shard is a view of its
old one wherever no boxing was needed, so a later in-place write through it still reaches the tensors
sharing its memory, as on one device. The general fallback restates its target too (`ops/program.py`):
these rules are here so that a split target keeps its split rather than being gathered.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .program import restate
from .registry import Rule, aten, no_signatures, register

TWINS = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


# where a view's rule makes a ragged tensor (a size-1 dim split unevenly, squeezed away: no data moved), the
# target, which is not one (a tensor's class is not changed in place), takes the copy twin's balanced result
COPIES = {aten.squeeze.default: aten.squeeze_copy.default, aten.squeeze.dim: aten.squeeze_copy.dim,
          aten.squeeze.dims: aten.squeeze_copy.dims, aten.view.default: aten.view_copy.default}


def balanced(view: Any, args: tuple, kwargs: dict) -> Any:
    """`view(*args)` dispatched, or its copy twin's where the view would be of another class (ragged, strided): the
    target keeps its class in place."""
    out = view(*args, **kwargs)
    if type(out) is not type(args[0]):
        out = COPIES[view](*args, **kwargs)
    return out


def in_place_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """The target takes its view twin's shard and layout, and the op's sizes and strides."""
    target = args[0]
    if target._layout.ragged_axes:
        raise NotImplementedError(f"{func}: a ragged tensor's sizes are data and its class is its own; use the "
                                  f"out-of-place view ({TWINS[func]}) instead")
    if target._is_view() and target.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            f"{func}: the tensor is a view that autograd records: for an in-place view of a view of a tensor "
            "subclass, autograd rebuilds it from its base with as_strided and the wrapper's own strides and offset "
            "(not replayed view by view), which a GlobalTensor's wrapper does not hold as one device's does, so a "
            f"later in-place write through it would get a wrong gradient; use the out-of-place view ({TWINS[func]})")
    view = balanced(TWINS[func], args, kwargs)
    restate(target, func, args, kwargs, view._local, view._layout)
    return target


register(list(TWINS), Rule(no_signatures, decompose=in_place_view))


def _row_major(t: torch.Tensor) -> bool:
    """Whether `t`'s strides are exactly the contiguous ones, size-1 dims included: a shard transposed from
    [1, n] to [n, 1] passes `is_contiguous` but holds a transposed view, which the stride of its size-1 dim
    still shows."""
    if t.numel() == 0:
        return True
    want = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if stride != want:
            return False
        want *= size
    return True


def _memory_format(args: tuple, kwargs: dict) -> Any:
    return kwargs.get("memory_format", args[2] if len(args) > 2 else None)


def resize(func: Any, args: tuple, kwargs: dict) -> Any:
    """resize_ / resize_as_ as a view of the target's elements in row-major order.

    On one device resize_ keeps the storage and lays the new sizes over it contiguously: the first
    elements in storage order, which are the tensor's elements in row-major order when it is contiguous.
    A global tensor has no storage beside its shards, so that is the only case computed: the same count
    of elements is a reshape, fewer a prefix of the flattened tensor, more only from an empty tensor (whose
    new elements torch leaves uninitialized; here zeros). A non-contiguous target (its storage order is not
    its order), a non-contiguous memory format, or growing a non-empty tensor (torch keeps the elements a
    former shrink left in the storage, which a global tensor does not) raise, naming the op. Whether the
    tensor is contiguous on one device is read off its wrapper (in-place views restate its strides) and this
    rank's shard (an out-of-place view's wrapper is contiguous, its shard is not): each rank reads its own.
    """
    target = args[0]
    if target._layout.ragged_axes:
        raise NotImplementedError(f"{func}: a ragged tensor's sizes are data; reshape it instead")
    sizes = tuple(args[1].shape) if func == aten.resize_as_.default else tuple(int(s) for s in args[1])
    if sizes == tuple(target.shape):
        return target  # torch leaves the tensor unchanged, strides included
    trial = torch.empty(tuple(target.shape), dtype=target.dtype, device="meta")
    margs = (trial, torch.empty(sizes, device="meta")) if func == aten.resize_as_.default else (trial, list(sizes))
    func(*margs, **kwargs)
    fmt = _memory_format(args, kwargs)
    if not trial.is_contiguous() or (fmt is not None and fmt != torch.contiguous_format):
        raise NotImplementedError(f"{func}: memory_format={fmt} lays the elements over the storage in another "
                                  "order than row-major, which a global tensor does not have; resize to the "
                                  "contiguous format and permute instead")
    if not target.is_contiguous() or not _row_major(target._local):
        raise NotImplementedError(f"{func}: the tensor is not contiguous, so resizing it reads its storage order, "
                                  "not its row-major order, and a global tensor has no storage beside its shards; "
                                  "call .clone(memory_format=torch.contiguous_format) first (or use reshape)")
    old, new = target.numel(), math.prod(sizes)
    if new == old:
        out = balanced(aten.view.default, (target, list(sizes)), {})
    elif new < old:
        flat = balanced(aten.view.default, (target, [-1]), {})
        out = balanced(aten.view.default, (aten.slice.Tensor(flat, 0, 0, new), list(sizes)), {})
    elif old == 0:
        out = aten.new_zeros.default(target, list(sizes))
    else:
        raise NotImplementedError(f"{func}: growing a non-empty tensor ({tuple(target.shape)} to {sizes}) keeps "
                                  "whatever its storage held beyond its elements, which a global tensor does not "
                                  "have; build the larger tensor (torch.cat with new values, or new_empty) instead")
    restate(target, func, args, kwargs, out._local, out._layout)
    return target


register([aten.resize_.default, aten.resize_as_.default], Rule(no_signatures, decompose=resize))


def addbmm_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    """addbmm_ computes addbmm into its target, of the result's shape whatever the target's: torch's CPU kernel
    resizes a target that only broadcasts ([1] beside [5, 10]), where its meta kernel (and every other in-place
    op) refuses. The product is the out-of-place addbmm (dispatched: its own rule decides its layout); a target
    of the result's shape takes its values in its own layout (copy_), another one takes the result whole."""
    target = args[0]
    out = aten.addbmm.default(*args, **kwargs)
    if tuple(out.shape) == tuple(target.shape):
        return aten.copy_.default(target, out)
    restate(target, aten.resize_.default, (target, list(out.shape)), {}, out._local, out._layout)
    return target


register([aten.addbmm_.default], Rule(no_signatures, decompose=addbmm_in_place))
