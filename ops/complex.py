"""Complex views and complex construction: rotary embeddings in complex arithmetic (Llama 4, DeepSeek-V2).

`view_as_complex` drops the last dim (of size 2: a real and an imaginary part) and `view_as_real`
adds it back; every other dim keeps its split, and both are linear (P passes). A split of the pair
dim itself cannot pass: half a pair is no complex number. `polar` and `complex` are pointwise.

The conjugate and negative *bits* (`x.conj()`, `x.conj().imag`) are lazy: `_conj` and `_neg_view` return
a view with a flag the Conjugate/Negative dispatch keys honour. Inside `__torch_dispatch__` torch
excludes those keys, so a shard that carried the flag would be read unconjugated by the next kernel
(complex mul's backward is `grad * other.conj()`: equal loss, wrong gradients). Their kernels here
compute the conjugate (the negation) into the shard instead, which is the value torch gives; what is
lost is only the aliasing of a lazy view: an in-place write through `x.conj()` could not reach `x`, so it
raises (`Rule.unaliased`), naming the view.
"""
from __future__ import annotations

from typing import Any

import torch

from .pointwise import elementwise_meta, linear
from .registry import Ctx, Rule, ShardSite, aten, register
from .view import dim_map_rule


def view_as_complex_map(ctx: Ctx) -> dict:
    """Every dim but the pair dim (the last) keeps its place."""
    return {d: d for d in range(len(ctx.shapes[0]) - 1)}


def view_as_real_map(ctx: Ctx) -> dict:
    """Every dim keeps its place; the new last dim (the pair) is never split."""
    return {d: d for d in range(len(ctx.shapes[0]))}


def view_as_complex_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The complex view of the shard, or of a contiguous copy where the shard's strides allow no view.

    A GlobalTensor reports contiguous strides whatever its shard's are, so a program that made its
    input contiguous (`x.transpose(3, 4).contiguous()`, DeepSeek-V2's pairs) did nothing to the shard;
    as `reshape` does, the kernel then copies (the values are the view's; only aliasing is lost).
    """
    x = args[0]
    if x.stride(-1) != 1 or any(st % 2 for st in x.stride()[:-1]) or x.storage_offset() % 2:
        x = x.new_empty(x.shape).copy_(x)  # not .contiguous(): an empty shard counts as contiguous already
    return func(x)


register([aten.view_as_complex.default], dim_map_rule(view_as_complex_map, view_as_complex_local))
register([aten.view_as_real.default], dim_map_rule(view_as_real_map))


def _flagged(func: Any, x: torch.Tensor) -> None:
    """A shard with a lazy conj/neg bit here came from outside the dispatcher (a plain `z.conj()` laid out
    as is): its kernels cannot honour the bit, so say so rather than compute on the raw storage."""
    if x.is_conj() or x.is_neg():
        raise ValueError(f"{func}: a shard carries a lazy conjugate/negative bit, which kernels inside the "
                         "dispatcher cannot honour; call .resolve_conj().resolve_neg() on the plain tensor "
                         "before laying it out (gt.to_global / from_local)")


def conj_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The conjugate computed into a new shard (no lazy bit: see the module's docstring)."""
    _flagged(func, args[0])
    return torch.conj_physical(args[0])


def neg_view_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The negation computed into a new shard (no lazy bit: see the module's docstring)."""
    _flagged(func, args[0])
    return torch.neg(args[0])


def _pointwise_with(kernel: Any) -> Rule:
    """A linear pointwise rule (every split passes, P passes) whose kernel is `kernel`."""
    base = linear(((0,),))
    return Rule(base.signatures, kernel=kernel, meta=elementwise_meta, unaliased=True)


register([aten._conj.default], _pointwise_with(conj_local))
register([aten._neg_view.default], _pointwise_with(neg_view_local))
# polar(abs, angle) = abs * e^(i angle): linear in abs alone; complex(real, imag): linear in both together
register([aten.polar.default], linear(((0,),)))
register([aten.complex.default], linear(((0, 1),)))
# the conjugate computed into new memory (resolve_conj, ihfftn's output): linear over the reals, so P passes
register([aten._conj_physical.default], linear(((0,),)))
