"""Factory `*_like`/`new_*` ops and random ops, with values that do not depend on the layout.

A random op draws the *global* tensor from this rank's generator (every rank
of an SPMD program holds the same generator state, as one device would) and
keeps its own shard, so `S(0)` on 2x2 equals one device with the same seed.
CPU generators cannot skip ahead, so the draw is made at global size; the
memory is transient and no communication is needed.
"""
from __future__ import annotations

from typing import Any

import torch

from ..layout import slice_box
from ..sbp import Broadcast, Partial
from .arguments import named_args
from .decide import map_tensors
from .pointwise import split_signatures
from .registry import B, P, S, Ctx, Rule, ShardSite, aten, no_signatures, register


def any_layout(out_of: callable):
    """Every input SBP is accepted as is; the output takes `out_of(input sbp)` (no boxing ever)."""
    def signatures(ctx: Ctx) -> list:
        n_in, n_out = len(ctx.shapes), len(ctx.out_shapes)
        options = [S(d) for d in range(len(ctx.shapes[0]))] + [B, P, Partial("max"), Partial("min")]
        return [((s,) * n_in, (out_of(s),) * n_out) for s in options]
    return signatures


def _no_partial(s):
    return B if isinstance(s, Partial) else s


def _broadcast(s):
    return B


def draw_global(fill, where: ShardSite, like: torch.Tensor, i: int = 0) -> torch.Tensor:
    """Draw the whole output with `fill` on a fresh global-size tensor and keep this rank's shard."""
    shape = where.ctx.out_shapes[i]
    full = fill(torch.empty(shape, dtype=like.dtype, device=like.device))
    local = slice_box(full, where.out_box(i))
    lay = where.out_layouts[i]
    coord = lay.placement.coord(where.rank)
    if any(isinstance(s, Partial) and s.op == "sum" and coord[a] != 0 for a, s in enumerate(lay.sbp)):
        return torch.zeros_like(local)
    return local.contiguous()


def random_like_local(func, args, kwargs, where: ShardSite):
    return draw_global(lambda full: func(full, *args[1:], **kwargs), where, args[0])


def random_inplace_local(func, args, kwargs, where: ShardSite):
    if args[0].device.type == "meta":
        return func(*args, **kwargs)
    args[0].copy_(draw_global(lambda full: func(full, *args[1:], **kwargs), where, args[0]))
    return args[0]


register([aten.zeros_like.default, aten.ones_like.default, aten.full_like.default], Rule(any_layout(_no_partial)))
register([aten.empty_like.default], Rule(any_layout(_no_partial), fresh=True))
register([aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype],
         Rule(any_layout(_no_partial), kernel=random_like_local))
def new_like(keep):
    """`x.new_*(size)`: of x's own size it is laid out like x (autograd's grad buffers are
    `new_empty_strided(...).copy_(grad)`, which must not gather); any other size is Broadcast."""
    def signatures(ctx: Ctx) -> list:
        same = ctx.out_shapes[0] == ctx.shapes[0]
        return any_layout(keep if same else _broadcast)(ctx)
    return signatures


def new_like_local(func, args, kwargs, where: ShardSite):
    """The size argument is global; the shard is this rank's piece of it (a split x gives a split output)."""
    size = list(where.out_shape(0))
    if func == aten.new_empty_strided.default:
        stride = [1] * len(size)
        for d in range(len(size) - 2, -1, -1):
            stride[d] = stride[d + 1] * max(size[d + 1], 1)
        return func(args[0], size, stride, *args[3:], **kwargs)
    return func(args[0], size, *args[2:], **kwargs)


register([aten.new_zeros.default], Rule(new_like(lambda s: s), kernel=new_like_local))
register([aten.new_empty.default, aten.new_empty_strided.default],
         Rule(new_like(lambda s: s), fresh=True, kernel=new_like_local))
register([aten.new_ones.default, aten.new_full.default], Rule(new_like(_no_partial), kernel=new_like_local))
register([aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default, aten.exponential_.default,
          aten.random_.default, aten.random_.to],
         Rule(any_layout(lambda s: s), kernel=random_inplace_local))


# -- random ops whose parameters are tensors, the in-place fills, rrelu ------------------------------------
# With the same semantics: every rank draws the *global* tensor from its
# generator (all ranks hold the same state, as one device would) and keeps its shard, so a split output
# equals one device's with the same seed.
#
# The in-place fills (cauchy_, geometric_, log_normal_) are `ops/random.py`'s in-place draw. The ops whose
# parameters are tensors (bernoulli(p), normal(mean, std), multinomial(probs)) draw as torch does, at
# global size, from global-size parameters in which this rank's shards sit at their place and a neutral
# value elsewhere: torch's kernels consume the generator by position, not by value (one uniform per
# element for bernoulli, standard normals scaled afterwards for normal, per row and sample for
# multinomial), so the elements a rank keeps are one device's. rrelu in training draws only for negative
# inputs (the draws a rank's elements take depend on every earlier element's sign): it runs on the whole
# input, and the noise it draws is copied back into the caller's (`rrelu`).
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
