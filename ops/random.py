"""Factory `*_like`/`new_*` ops and random ops, with values that do not depend on the layout.

A random op draws the *global* tensor from this rank's generator (every rank
of an SPMD program holds the same generator state, as one device would) and
keeps its own shard, so `S(0)` on 2x2 equals one device with the same seed.
CPU generators cannot skip ahead, so the draw is made at global size; the
memory is transient and no communication is needed.
"""
from __future__ import annotations

import torch

from ..layout import slice_box
from ..sbp import Partial
from .registry import B, Ctx, ShardSite, P, Rule, S, aten, register


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
