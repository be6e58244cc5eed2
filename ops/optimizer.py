"""The `_foreach_*` ops torch.optim uses: each runs as its per-tensor op through the dispatcher.

So the foreach and the for-loop optimizer paths share the per-tensor rules
and cache entries: `_foreach_lerp_(exp_avgs, grads, w)` is `lerp_(exp_avg, grad, w)`
per parameter, keeping each state's layout and boxing each gradient to it
(once per step: the dispatcher remembers a reduced Partial gradient while it is unchanged, `dispatch.box_global`).
"""
from __future__ import annotations

import torch

from .registry import Rule, aten, register

_VALUE_KWARG = {"addcmul", "addcmul_", "addcdiv", "addcdiv_"}  # their scalar is keyword-only per tensor


def foreach(func, args, kwargs):
    name = func._schema.name.split("::")[1][len("_foreach_"):]
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
