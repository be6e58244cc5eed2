"""The `_foreach_*` ops torch.optim uses: each runs as its per-tensor op through the dispatcher.

So the foreach and the for-loop optimizer paths share the per-tensor rules
and cache entries: `_foreach_lerp_(exp_avgs, grads, w)` is `lerp_(exp_avg, grad, w)`
per parameter, keeping each state's layout and boxing each gradient to it
(once per step: the dispatcher remembers a reduced Partial gradient while it is unchanged, `dispatch.box_global`).

Except where there is nothing to decide: an elementwise foreach op whose tensors at each index share
one layout without Partial (a ZeRO step: parameter, gradient and state all `S(0)`; scalars and 0-dim
Broadcast tensors aside) runs torch's foreach kernel once on the local shards, as on one device,
instead of one dispatch per tensor.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..sbp import Broadcast
from .inputs import settle_step
from .registry import Rule, aten, register

_SETTLE = register_optimizer_step_pre_hook(settle_step)  # pending gradients reduced as a step begins

_VALUE_KWARG = {"addcmul", "addcmul_", "addcdiv", "addcdiv_"}  # their scalar is keyword-only per tensor


_NOT_ELEMENTWISE = {"norm", "max"}  # reductions: their own rules or the per-tensor path
_PER_TENSOR = {"zero_"}  # their per-tensor op has more to do than its kernel (pointwise.zero_in_place)


def _same_layouts(args: tuple, kwargs: dict) -> Optional[type]:
    """The GlobalTensor class if every index's tensors share one Partial-free layout, shape and dtype (tensor
    scalars: 0-dim Broadcast on that placement), else None. Compared by their interned dispatch keys
    (`ops/keys.py`: one object per layout, shape and dtype): an identity test per tensor, not a Layout and a
    shape comparison (AdamW's step over a 2-stage small GPT: 6.3-6.9 -> 4.6-4.9 ms CPU per rank), and each
    distinct key's layout looked at once."""
    lists, singles = [], []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) is list or type(a) is tuple:
            if a and isinstance(a[0], torch.Tensor):
                lists.append(a)
        elif isinstance(a, torch.Tensor):
            singles.append(a)
    if not lists:
        return None
    keys = [getattr(t, "_key", None) for t in lists[0]]
    for a in lists[1:]:
        for t, key in zip(a, keys):
            if getattr(t, "_key", None) is not key:
                return None
    places = set()
    for key in set(keys):
        if key is None or key.layout.has_partial:
            return None
        places.add(key.layout.placement)
    for t in singles:  # a scalar from another placement: the per-tensor path places it (ops/span.py)
        lay = getattr(t, "_layout", None)
        if t.dim() != 0 or (lay is not None and (lay.sbp != (Broadcast(),) * lay.placement.ndim
                                                 or places != {lay.placement})):
            return None
    return type(lists[0][0])


def _local(a: Any) -> Any:
    """An argument with its GlobalTensors' local shards (a list's elements too)."""
    if type(a) is list or type(a) is tuple:
        return [x._local for x in a] if a and isinstance(a[0], torch.Tensor) else a
    return a._local if isinstance(a, torch.Tensor) and hasattr(a, "_local") else a


def _on_local_shards(func: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """torch's foreach kernel once, on the indices whose shards hold elements: a pipeline's optimizer lists
    every stage's parameters, and on a rank outside a stage those shards are empty (a 2-stage GPT's AdamW:
    half of each list). An empty shard's result is empty; only an out-of-place op needs it made."""
    args = [_local(a) for a in args]
    kwargs = {k: _local(v) for k, v in kwargs.items()}
    like = next(a for a in args if type(a) is list and a and isinstance(a[0], torch.Tensor))
    n = len(like)
    keep = [i for i, t in enumerate(like) if t.numel()]
    if len(keep) < n:
        def pick(a: Any) -> Any:
            return [a[i] for i in keep] if (type(a) is list or type(a) is tuple) and len(a) == n else a
        got = func(*[pick(a) for a in args], **{k: pick(v) for k, v in kwargs.items()}) if keep else None
        if name.endswith("_"):
            return None
        got = iter(got or ())
        kept = set(keep)
        return [next(got) if i in kept else torch.empty_like(t) for i, t in enumerate(like)]
    return func(*args, **kwargs)


def foreach(func, args, kwargs):
    name = func._schema.name.split("::")[1][len("_foreach_"):]
    cls = None if name.rstrip("_") in _NOT_ELEMENTWISE or name in _PER_TENSOR else _same_layouts(args, kwargs)
    if cls is not None:
        out = _on_local_shards(func, name, args, kwargs)
        if name.endswith("_"):
            return None
        like = next(a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor))
        return [cls(o, t._layout, tuple(t.shape)) for o, t in zip(out, like)]
    elem = getattr(aten, name)
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    results = []
    for i in range(n):
        a = [x[i] if isinstance(x, (list, tuple)) else x for x in args]
        kw = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}
        if name in _VALUE_KWARG and len(a) > 3:
            kw["value"] = a.pop(3)
        results.append(elem(*a, **kw))
    return None if name.endswith("_") else results


FOREACH = [getattr(aten, n) for n in sorted({s.name.split("::")[1] for s in torch._C._jit_get_all_schemas()
                                             if s.name.startswith("aten::_foreach_")})]
register([getattr(p, o) for p in FOREACH for o in p.overloads() if "out" not in o], Rule(lambda ctx: [], decompose=foreach))
