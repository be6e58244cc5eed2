"""Random ops beyond `ops/random.py`'s, with its semantics: every rank draws the *global* tensor from its
generator (all ranks hold the same state, as one device would) and keeps its shard, so a split output
equals one device's with the same seed.

The in-place fills (cauchy_, geometric_, log_normal_) are `ops/random.py`'s in-place draw. The ops whose
parameters are tensors (bernoulli(p), normal(mean, std), multinomial(probs)) draw as torch does, at
global size, from global-size parameters in which this rank's shards sit at their place and a neutral
value elsewhere: torch's kernels consume the generator by position, not by value (one uniform per
element for bernoulli, standard normals scaled afterwards for normal, per row and sample for
multinomial), so the elements a rank keeps are one device's. rrelu in training draws only for negative
inputs (the draws a rank's elements take depend on every earlier element's sign): it runs on the whole
input, and the noise it draws is copied back into the caller's (`rrelu`).
"""
from __future__ import annotations

from typing import Any

import torch

from ..layout import slice_box
from ..sbp import Broadcast
from .arguments import named_args
from .decide import map_tensors
from .pointwise import split_signatures
from .random import any_layout, random_inplace_local
from .registry import B, Ctx, P, Rule, S, ShardSite, aten, no_signatures, register

register([aten.cauchy_.default, aten.geometric_.default, aten.log_normal_.default],
         Rule(any_layout(lambda s: s), kernel=random_inplace_local))


def embedded_draw(neutral: float):
    """The op on global-size parameters (this rank's shards in place, `neutral` elsewhere), the output
    shard kept."""
    def local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
        if where.checking:
            return func(*args, **kwargs)

        def embed(t: torch.Tensor, i: int) -> torch.Tensor:
            full = torch.full(where.ctx.shapes[i], neutral, dtype=t.dtype, device=t.device)
            slice_box(full, where.in_box(i)).copy_(t)
            return full
        gargs, gkwargs = map_tensors(args, kwargs, embed)
        return slice_box(func(*gargs, **gkwargs), where.out_box(0)).contiguous()
    return local


register([aten.bernoulli.default, aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor],
         Rule(split_signatures, kernel=embedded_draw(0.0)))


def multinomial_signatures(ctx: Ctx) -> list:
    """probs [N, C] -> samples [N, k]: rows split (each row is drawn on its own); a row's classes are not."""
    return [((S(0),), (S(0),))] if len(ctx.shapes[0]) == 2 else []


register([aten.multinomial.default], Rule(multinomial_signatures, kernel=embedded_draw(1.0)))


def _rrelu_decomposes(ctx: Ctx, layouts: tuple) -> bool:
    """Eval mode always (it is leaky_relu); training where some input is not whole."""
    return not ctx.named("training") or any(not isinstance(s, Broadcast) for lay in layouts for s in lay.sbp)


def rrelu(func: Any, args: tuple, kwargs: dict) -> Any:
    """rrelu_with_noise(_): in eval mode torch computes leaky_relu with slope (lower + upper) / 2 (no draw,
    the noise untouched), elementwise on any layout. In training the draws follow the whole input's signs:
    the op runs on the whole input with a whole noise buffer, which is then copied into the caller's noise
    (the backward reads it: the noise is an argument the op writes, which a replicated run would fill
    only in its gathered copy)."""
    named = named_args(func, args, kwargs)
    x, noise, inplace = named["self"], named["noise"], func == aten.rrelu_with_noise_.default
    if not named["training"]:
        slope = (named["lower"] + named["upper"]) / 2
        return (aten.leaky_relu_.default if inplace else aten.leaky_relu.default)(x, slope)

    def whole(t: Any) -> Any:
        return t.to_global(t.placement, (B,) * len(t.sbp)) if hasattr(t, "placement") else t
    xb = whole(x)
    nb = aten.empty_like.default(xb)
    out = aten.rrelu_with_noise.default(xb, nb, named["lower"], named["upper"], True, named["generator"])
    aten.copy_.default(noise, nb)
    if inplace:
        aten.copy_.default(x, out)
        return x
    return out


register([aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default],
         Rule(no_signatures, decompose=rrelu, decompose_when=_rrelu_decomposes))


def rrelu_backward_signatures(ctx: Ctx) -> list:
    """(grad, input, noise) -> grad of input, elementwise (the noise the forward drew); linear in grad."""
    return split_signatures(ctx) + [((P, B, B), (P,))]


register([aten.rrelu_with_noise_backward.default], Rule(rrelu_backward_signatures))
