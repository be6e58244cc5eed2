"""Python values read from GlobalTensors: `.item()`, `float(x)`, `bool(x)`, `torch.equal`; and `any`/`all`.

A Python value steers every rank's control flow, so it is read from the global value on every rank of
the placement: a Broadcast input gives it with no communication, a Partial one after a reduction of its
one element, a split one after a gather of it (`_local_scalar_dense` has only the implied all-Broadcast
signature: no fallback, and boxing prices the conversion). A rank outside the placement has no value
to read and is told so.

`any`/`all` over a split dim leave each rank the answer for its shard, `P(max)`/`P(min)` booleans (the
identities False/True are what an empty shard gives), reduced one byte per element when read. A
Partial input passes only when boolean: `any` of a sum is not the max of the ranks' `any`s.

`_assert_async` (what `torch._check` and traced checks such as `one_hot`'s leave in a compiled graph: `all` of a
test, then the assert) takes an `all`'s P(min) where it is: the global truth is every rank's, so each rank asserts
its own part, as the op's eager kernel checks its own shard, instead of reducing a byte per check.

`torch.equal(a, b)` is `eq`, `all`, then `item`: the shards are compared where they are and one
boolean is reduced, instead of both tensors being gathered.
"""
from __future__ import annotations

from typing import Any

import torch

from .reduction import reduced_dims
from .registry import PMAX, PMIN, Ctx, Rule, S, aten, no_signatures, register


def _scalar_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """A Python number stands for the value: the decision needs to know there is no tensor output."""
    return 0


def truth_reduction(partial: Any) -> Rule:
    """`any` (P(max)) or `all` (P(min)): split non-reduced dims pass, a split reduced dim gives `partial`."""
    def signatures(ctx: Ctx) -> list:
        dims, keep = reduced_dims(ctx)
        sigs = []
        for d in range(len(ctx.shapes[0])):
            if d in dims:
                sigs.append(((S(d),), (partial,)))
            else:
                sigs.append(((S(d),), (S(d if keep else d - sum(r < d for r in dims)),)))
        if ctx.args[0].dtype == torch.bool:
            sigs.append(((partial,), (partial,)))
        return sigs
    return Rule(signatures)


def equal(func: Any, args: tuple, kwargs: dict) -> bool:
    """Same shape and every element equal: compared shard by shard, one boolean reduced."""
    a, b = args[0], args[1]
    if tuple(a.shape) != tuple(b.shape):
        return False
    return bool(aten._local_scalar_dense.default(aten.all.default(aten.eq.Tensor(a, b))))


register([aten._local_scalar_dense.default], Rule(no_signatures, meta=_scalar_meta))
register([aten.any.default, aten.any.dim, aten.any.dims], truth_reduction(PMAX))
register([aten.all.default, aten.all.dim, aten.all.dims], truth_reduction(PMIN))
register([aten.equal.default], Rule(no_signatures, decompose=equal))
register([aten._assert_async.default, aten._assert_async.msg],
         Rule(lambda ctx: [((PMIN,), ())] if ctx.args[0].dtype == torch.bool else [], meta=lambda *a: None))
