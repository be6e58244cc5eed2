"""nll_loss (cross_entropy is log_softmax + nll_loss): split batch, or split classes (vocab-parallel).

With reduction 'mean' the normaliser is the global total weight. Unweighted,
a batch-split mean is decomposed: the 'sum' loss (P over the batch split)
divided by the count of scored targets, itself a P scalar all-reduced once
(4 bytes, where gathering the target would move the whole batch's). With
class weights the batch-split form still reads the whole (small, integer)
target, and each rank divides its partial sum by the global total weight.
With split classes each rank scores only targets in its class range.

mse_loss is elementwise before its reduction: split operands give each rank
its part of the sum (P), and 'mean' divides that by the global count.
"""
from __future__ import annotations

import math

import torch

from .registry import B, Ctx, ShardSite, P, Rule, S, aten, pointwise_dims, reduce_partial, register, split_on

NONE, MEAN, SUM = 0, 1, 2


def _args(args: tuple, kwargs: dict, names: tuple) -> list:
    return [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]


FWD = ("self", "target", "weight", "reduction", "ignore_index")
BWD = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")


def global_total_weight(target: torch.Tensor, weight, ignore_index: int, dtype) -> torch.Tensor:
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(dtype)
    return torch.where(valid, weight[target.masked_fill(~valid, 0)], 0).sum().to(dtype)


def _class_shift(target: torch.Tensor, start: int, size: int, ignore_index: int) -> torch.Tensor:
    outside = (target < start) | (target >= start + size) | (target == ignore_index)
    return (target - start).masked_fill(outside, ignore_index)


def forward_signatures(ctx: Ctx) -> list:
    if len(ctx.shapes[0]) != 2:
        return []
    reduction = ctx.arg(3, "reduction")
    w = (B,) * (len(ctx.shapes) - 2)
    sigs = [((S(0), B if reduction == MEAN else S(0)) + w, (S(0) if reduction == NONE else P, B if reduction != SUM else P))]
    if not w:
        sigs.append(((S(1), B), (P, B)))
    return sigs


def forward_local(func, args, kwargs, where: ShardSite):
    x, target, weight, reduction, ignore = _args(args, kwargs, FWD)
    (rstart, rsize), (cstart, csize) = where.in_box(0)
    n, c = where.ctx.shapes[0]
    if csize != c:
        target = _class_shift(target, cstart, csize, ignore)
    elif reduction == MEAN and rsize != n:
        target_all, target = target, target.narrow(0, rstart, rsize)
    if reduction != MEAN or (csize == c and rsize == n):
        out, tw = func(x, target, weight, reduction, ignore)
        return out, tw
    full = target_all if csize == c else args[1]
    tw = global_total_weight(full, weight, ignore, x.dtype)
    out, _ = func(x, target, weight, SUM, ignore)
    return out / tw, tw


def backward_signatures(ctx: Ctx) -> list:
    if len(ctx.shapes[1]) != 2:
        return []
    reduction = ctx.arg(4, "reduction")
    w = (B,) * (len(ctx.shapes) - 4)
    grad = S(0) if reduction == NONE else B
    sigs = [((grad, S(0), S(0)) + w + (P if reduction == SUM else B,), (S(0),)),
            ((P, B, B) + w + (B,), (P,))]
    if not w:
        sigs.append(((B, S(1), B, B), (S(1),)))
    return sigs


def backward_local(func, args, kwargs, where: ShardSite):
    grad, x, target, weight, reduction, ignore, tw = _args(args, kwargs, BWD)
    cstart, csize = where.in_box(1)[1]
    if csize != where.ctx.shapes[1][1]:
        target = _class_shift(target, cstart, csize, ignore)
    return func(grad, x, target, weight, reduction, ignore, tw)


def _batch_split_mean(ctx: Ctx, layouts: tuple) -> bool:
    return ctx.arg(3, "reduction") == MEAN and len(ctx.shapes) == 2 and len(ctx.shapes[0]) == 2 and \
        any(split_on(lay, 0) for lay in layouts)


def _mean_as_sum(func, args, kwargs):
    """Unweighted mean over a split batch: sum of the losses / all-reduced count of scored targets."""
    x, target, _, _, ignore = _args(args, kwargs, FWD)
    total, _ = func(x, target, None, SUM, ignore)
    count = aten.sum.default(aten.ne.Scalar(target, ignore), dtype=x.dtype)
    count = reduce_partial(count)
    return aten.div.Tensor(total, count), count


register([aten.nll_loss_forward.default],
         Rule(forward_signatures, kernel=forward_local, decompose=_mean_as_sum, decompose_when=_batch_split_mean))
register([aten.nll_loss_backward.default], Rule(backward_signatures, kernel=backward_local))


# -- mse_loss ------------------------------------------------------------------------------------
def _broadcast_shape(ctx: Ctx, slots: range) -> tuple:
    shape = torch.Size()
    for i in slots:
        shape = torch.broadcast_shapes(shape, ctx.shapes[i])
    return tuple(shape)


def mse_signatures(ctx: Ctx) -> list:
    """(input, target): elementwise, so any dim of their broadcast shape may be split. Reduced, a
    split gives each rank the sum of its squared errors (P); 'mean' divides it by the global count."""
    out = _broadcast_shape(ctx, range(2))
    whole = ctx.arg(2, "reduction", MEAN) == NONE
    sigs = [(tuple(pointwise_dims(s, out, d) for s in ctx.shapes), (S(d) if whole else P,)) for d in range(len(out))]
    return sigs


def mse_backward_signatures(ctx: Ctx) -> list:
    """(grad, input, target) -> grad_input: split like the forward's elementwise part, the grad of a
    reduced loss (a scalar) whole; linear in grad, so a P grad passes with the rest whole."""
    out = ctx.out_shapes[0]
    sigs = [(tuple(pointwise_dims(s, out, d) for s in ctx.shapes), (S(d),)) for d in range(len(out))]
    return sigs + [((P, B, B), (P,))]


def _mean_over_global(count_of, reduction_arg: int):
    """A 'mean' kernel on shards: the 'sum' kernel divided by the global element count."""
    def local(func, args, kwargs, where: ShardSite):
        reduction = args[reduction_arg] if len(args) > reduction_arg else kwargs.get("reduction", MEAN)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if reduction != MEAN or all(tuple(t.shape) == s for t, s in zip(tensors, where.ctx.shapes)):
            return func(*args, **kwargs)  # whole operands: torch's own mean
        args = list(args[:reduction_arg]) + [SUM] + list(args[reduction_arg + 1:])
        kwargs = {k: v for k, v in kwargs.items() if k != "reduction"}
        return func(*args, **kwargs) / count_of(where.ctx)
    return local


register([aten.mse_loss.default],
         Rule(mse_signatures, kernel=_mean_over_global(lambda c: math.prod(_broadcast_shape(c, range(2))), 2)))
register([aten.mse_loss_backward.default],
         Rule(mse_backward_signatures, kernel=_mean_over_global(lambda c: math.prod(_broadcast_shape(c, range(1, 3))),
                                                               3)))
