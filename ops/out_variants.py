"""`out=` variants: the functional op, then a copy into each `out` tensor, which keeps its own layout.

Without this an `out=` call fell back (no rule names those overloads): its `out` GlobalTensor was boxed
to Broadcast, the kernel wrote the copy, and a split `out` never saw the values (silently left as it
was). Running the functional twin (the same packet's overload with the same arguments but the outs)
through the dispatcher gives it its own rule (a scan, a split matmul), and `copy_` boxes the result
into each `out` as an in-place write does. Overloads with no twin (factories: `arange.out`,
`full.out`, whose functional forms take dtype and device instead) are refused where an `out` is a
GlobalTensor, naming the argument: a wrong answer is worse than an error.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

from .registry import RULES, Rule, aten, aten_overloads, register, writes_out


def _key(schema: Any) -> tuple:
    return tuple((a.name, str(a.type)) for a in schema.arguments if not a.is_out)


@lru_cache(maxsize=None)  # per overload, once: not a walk of the packet at every call
def _functional_twin(op: Any) -> Optional[Any]:
    """The overload of `op`'s packet that takes the same arguments but the outs and writes none."""
    packet = getattr(aten, op._schema.name.split("::")[1])
    want = _key(op._schema)
    for name in packet.overloads():
        twin = getattr(packet, name)
        args = twin._schema.arguments
        if twin is op or any(a.is_out or (a.alias_info is not None and a.alias_info.is_write) for a in args):
            continue
        if _key(twin._schema) == want:
            return twin
    return None


@lru_cache(maxsize=None)
def _out_names(op: Any) -> tuple:
    return tuple(a.name for a in op._schema.arguments if a.is_out)


def _run_out_variant(func: Any, args: tuple, kwargs: dict) -> Any:
    names = _out_names(func)
    outs = [kwargs[n] for n in names]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    twin = _functional_twin(func)
    if twin is None:
        raise NotImplementedError(
            f"{func}(out=): {', '.join(names)} is a GlobalTensor and this op has no functional form to run "
            f"and copy from; call it without out= and assign the result (or copy_ it into the tensor)")
    result = twin(*args, **rest)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for name, out, res in zip(names, outs, results):
        if tuple(out.shape) != tuple(res.shape):
            raise ValueError(f"{func}({name}=): it has shape {tuple(out.shape)}, the result {tuple(res.shape)}; "
                             f"a GlobalTensor is not resized in place: give an {name} of the result's shape")
        out.copy_(res)
    return outs[0] if len(outs) == 1 else tuple(outs)


register([op for op in aten_overloads() if writes_out(op) and op not in RULES],
         Rule(lambda ctx: [], decompose=_run_out_variant))
