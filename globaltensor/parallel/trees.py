"""The tensors in a module's inputs and outputs, found and replaced through `torch.utils._pytree`.

Why pytree: it is torch's own walk (FSDP2, torch.compile, export use it), so a container keeps its type
where a hand walk rebuilt a dict subclass as a plain `dict` and broke a named tuple; a model's own
output class registered there (Hugging Face's `ModelOutput` is) keeps its type too. A container pytree
does not know is a leaf, as it is to torch. A tensor, a GlobalTensor included, is a leaf: never walked
into. A bare tensor, and a plain tuple of tensors (a module's positional arguments, in a pipeline's hot
path), skip pytree: flattening costs microseconds where an `isinstance` costs tens of nanoseconds.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree


def _flat(obj: Any) -> bool:
    """Whether `obj` is a plain tuple of tensors (a module's positional arguments, mostly): no pytree needed."""
    if type(obj) is not tuple:
        return False
    for o in obj:
        if not isinstance(o, torch.Tensor):
            return False
    return True


def map_tensors(fn: Callable[..., Any], obj: Any, kind: type = torch.Tensor, *args: Any) -> Any:
    """`obj` with `fn(t, *args)` in place of each tensor `t` of type `kind` in it; `obj` itself where `fn`
    changed nothing (callers compare by identity, and rebuilding costs)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, *args) if isinstance(obj, kind) else obj
    if _flat(obj):
        out, changed = [], False
        for o in obj:
            new = fn(o, *args) if isinstance(o, kind) else o
            changed = changed or new is not o
            out.append(new)
        return tuple(out) if changed else obj
    leaves, spec = pytree.tree_flatten(obj)
    out = [fn(o, *args) if isinstance(o, kind) else o for o in leaves]
    for new, old in zip(out, leaves):
        if new is not old:
            return pytree.tree_unflatten(out, spec)
    return obj


def tensors(obj: Any, into: Optional[list] = None) -> list:
    """The tensors in `obj`, in pytree's order, appended to `into` (a new list by default)."""
    out = [] if into is None else into
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif _flat(obj):
        out.extend(obj)
    else:
        out.extend(o for o in pytree.tree_leaves(obj) if isinstance(o, torch.Tensor))
    return out
