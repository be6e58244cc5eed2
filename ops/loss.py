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
from typing import Any

import torch

from ..sbp import Broadcast
from .arguments import named_args
from .pointwise import split_signatures
from .registry import B, P, S, Ctx, Rule, ShardSite, aten, pointwise_dims, reduce_partial, register, split_on


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


# -- losses beyond nll_loss and mse_loss ------------------------------------------------------------------
# Elementwise ones, margin ones over a batch,
# nll_loss2d (cross_entropy on images), log_sigmoid, CTC.
#
# Elementwise losses (binary_cross_entropy(_with_logits), huber, smooth_l1, soft_margin) and their
# backwards split any dim of their operands' broadcast shape: 'none' keeps the split, 'sum' leaves each
# rank the sum of its elements' losses (P), and 'mean' divides that sum by the global count (the shards'
# quotients add up to the mean). A loss is not linear in its input, so no P input passes, except the
# incoming gradient of a backward (linear in it, the rest whole).
#
# Per-sample losses (multi_margin, multilabel_margin, CTC) split the batch (dim 0; CTC's log_probs carry
# it on dim 1), and their 'mean' divides by the global batch. nll_loss2d splits the batch or an image dim
# (the target carries them alike) as `ops/loss.py`'s nll_loss splits the batch, or the classes.
def _reduction(ctx: Ctx) -> int:
    return ctx.named("reduction", MEAN)


def _whole(args: tuple, kwargs: dict, ctx: Ctx) -> bool:
    """Whether every tensor argument is its whole global tensor here (torch's own 'mean' then holds)."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    return all(tuple(t.shape) == s for t, s in zip(tensors, ctx.shapes))


def mean_over_global(count_of):
    """A 'mean' kernel on shards: the op's 'sum' divided by the global count `count_of(ctx)`."""
    def local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
        named = named_args(func, args, kwargs)
        if named["reduction"] != MEAN or _whole(args, kwargs, where.ctx):
            return func(*args, **kwargs)
        named["reduction"] = SUM
        out = func(*named.values())
        count = count_of(where.ctx)
        if isinstance(out, tuple):
            return (out[0] / count,) + tuple(out[1:])
        return out / count
    return local


# -- elementwise losses ------------------------------------------------------------------------------------
def _broadcast(shapes: tuple) -> tuple:
    out = torch.Size()
    for s in shapes:
        out = torch.broadcast_shapes(out, s)
    return tuple(out)


def elementwise_signatures(ctx: Ctx) -> list:
    """Every tensor input broadcast to their common shape: any dim of it split, the loss S or P."""
    out = _broadcast(ctx.shapes)
    reduced = _reduction(ctx) != NONE
    return [(tuple(pointwise_dims(s, out, d) for s in ctx.shapes), (P if reduced else S(d),))
            for d in range(len(out))]


def elementwise_backward_signatures(ctx: Ctx) -> list:
    """(grad, input, target, ...) -> grad of input: split alike (a reduced loss's grad is a scalar, whole);
    a P grad with the rest whole."""
    out = ctx.out_shapes[0]
    sigs = [(tuple(pointwise_dims(s, out, d) for s in ctx.shapes), (S(d),)) for d in range(len(out))]
    return sigs + [((P,) + (B,) * (len(ctx.shapes) - 1), (P,))]


def _numel_forward(ctx: Ctx) -> int:
    return math.prod(_broadcast(ctx.shapes))


def _numel_backward(ctx: Ctx) -> int:
    return math.prod(ctx.out_shapes[0])


ELEMENTWISE = [aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default,
               aten.huber_loss.default, aten.smooth_l1_loss.default, aten.soft_margin_loss.default]
ELEMENTWISE_BACKWARD = [aten.binary_cross_entropy_backward.default, aten.huber_loss_backward.default,
                        aten.smooth_l1_loss_backward.default, aten.soft_margin_loss_backward.default]
register(ELEMENTWISE, Rule(elementwise_signatures, kernel=mean_over_global(_numel_forward)))
register(ELEMENTWISE_BACKWARD, Rule(elementwise_backward_signatures, kernel=mean_over_global(_numel_backward)))


# -- per-sample losses: the batch split ----------------------------------------------------------------
def margin_signatures(n_batched: int):
    """(input [N, C], target, ...): the first `n_batched` tensors split on the batch, the rest (a class
    weight) whole; the loss and every other output S(0) for 'none', the loss P reduced."""
    def signatures(ctx: Ctx) -> list:
        if len(ctx.shapes[0]) != 2:
            return []
        ins = (S(0),) * n_batched + (B,) * (len(ctx.shapes) - n_batched)
        loss = S(0) if _reduction(ctx) == NONE else P
        return [(ins, (loss,) + (S(0),) * (len(ctx.out_shapes) - 1))]
    return signatures


def margin_backward_signatures(n_batched: int):
    """(grad, input [N, C], ...): the batch split (grad too when 'none'); a P grad with the rest whole."""
    def signatures(ctx: Ctx) -> list:
        if len(ctx.shapes[1]) != 2:
            return []
        grad = S(0) if _reduction(ctx) == NONE else B
        rest = len(ctx.shapes) - 1 - n_batched
        return [((grad,) + (S(0),) * n_batched + (B,) * rest, (S(0),)),
                ((P,) + (B,) * (len(ctx.shapes) - 1), (P,))]
    return signatures


def _forward_batch(ctx: Ctx) -> int:
    return ctx.shapes[0][0]


def _backward_batch(ctx: Ctx) -> int:
    return ctx.shapes[1][0]


def like_input(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """A backward's gradient of its input (argument 1), on meta: these backwards have no meta kernel."""
    return torch.empty_like(args[1], device="meta")


def checked_like_input(kernel):
    """`kernel`, but on the dispatcher's meta shards (`valid`) the gradient's shard from `like_input`."""
    def local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
        if args[1].device.type == "meta":
            return like_input(func, args, kwargs)
        return kernel(func, args, kwargs, where)
    return local


register([aten.multi_margin_loss.default],
         Rule(margin_signatures(2), kernel=mean_over_global(_forward_batch)))
register([aten.multi_margin_loss_backward.default],
         Rule(margin_backward_signatures(2), kernel=checked_like_input(mean_over_global(_backward_batch)), meta=like_input))
register([aten.multilabel_margin_loss_forward.default],
         Rule(margin_signatures(2), kernel=mean_over_global(_forward_batch)))
register([aten.multilabel_margin_loss_backward.default],
         Rule(margin_backward_signatures(3), kernel=checked_like_input(mean_over_global(_backward_batch)), meta=like_input))


# -- nll_loss2d -------------------------------------------------------------------------------------------
CARRIED_2D = ((0, 0), (2, 1), (3, 2))  # (input dim, target dim): batch, height, width


def nll2d_signatures(ctx: Ctx) -> list:
    """input [N, C, H, W], target [N, H, W]: a batch or image dim split alike ('mean': the target whole,
    the kernel dividing by the global total weight), or the classes (each rank scores its class range)."""
    reduction = _reduction(ctx)
    w = (B,) * (len(ctx.shapes) - 2)
    sigs = [((S(i), B if reduction == MEAN else S(t)) + w,
             (S(t) if reduction == NONE else P, P if reduction == SUM else B)) for i, t in CARRIED_2D]
    if not w:
        sigs.append(((S(1), B), (P, B)))
    return sigs


def nll2d_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    named = named_args(func, args, kwargs)
    x, target, weight, reduction, ignore = (named[k] for k in ("self", "target", "weight", "reduction",
                                                               "ignore_index"))
    box = where.in_box(0)
    (cstart, csize), c = box[1], where.ctx.shapes[0][1]
    full_target = target
    if tuple(target.shape) != tuple(x.shape[:1] + x.shape[2:]):  # a whole target ('mean'): this shard's part
        for i, t in CARRIED_2D:
            target = target.narrow(t, box[i][0], box[i][1])
    if csize != c:
        target = _class_shift(target, cstart, csize, ignore)
    if reduction != MEAN or _whole(args, kwargs, where.ctx):
        return func(x, target, weight, reduction, ignore)
    tw = global_total_weight(full_target, weight, ignore, x.dtype)
    out, _ = func(x, target, weight, SUM, ignore)
    return out / tw, tw


def _unweighted_split_mean(ctx: Ctx, layouts: tuple) -> bool:
    """Unweighted 'mean' with something split: the 'sum' over the P count of scored targets (one scalar
    reduced, where the kernel's form needs the whole target)."""
    return _reduction(ctx) == MEAN and len(ctx.shapes) == 2 and \
        any(not isinstance(s, Broadcast) for lay in layouts for s in lay.sbp)


def nll2d_backward_signatures(ctx: Ctx) -> list:
    """(grad, input, target, weight?, total_weight) -> grad of input, split as the forward; the total weight
    (global) whole, or P for 'sum' (unused there); a P grad; the classes."""
    reduction = _reduction(ctx)
    w = (B,) * (len(ctx.shapes) - 4)
    tw = P if reduction == SUM else B
    sigs = [((S(t) if reduction == NONE else B, S(i), S(t)) + w + (tw,), (S(i),)) for i, t in CARRIED_2D]
    sigs.append(((P, B, B) + w + (B,), (P,)))
    if not w:
        sigs.append(((B, S(1), B, B), (S(1),)))
    return sigs


def nll2d_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    named = named_args(func, args, kwargs)
    cstart, csize = where.in_box(1)[1]
    if csize != where.ctx.shapes[1][1]:
        named["target"] = _class_shift(named["target"], cstart, csize, named["ignore_index"])
    return func(*named.values())


register([aten.nll_loss2d_forward.default], Rule(nll2d_signatures, kernel=nll2d_local, decompose=_mean_as_sum,
                                                 decompose_when=_unweighted_split_mean))
register([aten.nll_loss2d_backward.default], Rule(nll2d_backward_signatures, kernel=nll2d_backward_local))


# -- log_sigmoid -------------------------------------------------------------------------------------------
def log_sigmoid_signatures(ctx: Ctx) -> list:
    """Elementwise; the buffer (empty on CPU and CUDA) is whole unless it has the input's shape."""
    out = ctx.shapes[0]
    buf = ctx.out_shapes[1]
    return [((S(d),), (S(d), S(d) if buf == out else B)) for d in range(len(out))]


def log_sigmoid_backward_signatures(ctx: Ctx) -> list:
    return split_signatures(ctx) + [((P, B, B), (P,))]


register([aten.log_sigmoid_forward.default], Rule(log_sigmoid_signatures))
register([aten.log_sigmoid_backward.default], Rule(log_sigmoid_backward_signatures))


# -- CTC: the batch split ----------------------------------------------------------------------------------
def ctc_signatures(ctx: Ctx) -> list:
    """log_probs [T, N, C], targets [N, S] (padded; concatenated 1-D targets need offsets: whole), lengths
    [N] (tensors, or int lists the kernel cuts) -> (nll [N], log_alpha [N, T, L]), all split on N."""
    if len(ctx.shapes[0]) != 3 or len(ctx.shapes[1]) != 2:
        return []
    return [((S(1),) + (S(0),) * (len(ctx.shapes) - 1), (S(0), S(0)))]


def _cut_lengths(named: dict, start: int, size: int) -> None:
    for k in ("input_lengths", "target_lengths"):
        if isinstance(named[k], (list, tuple)):
            named[k] = list(named[k])[start:start + size]


def ctc_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """The shard's samples; log_alpha's last dim (2 * longest target + 1 of the samples seen) padded to the
    global one with -inf (the backward reads each sample's own range only)."""
    named = named_args(func, args, kwargs)
    start, size = where.in_box(0)[1]
    _cut_lengths(named, start, size)
    nll, alpha = func(*named.values())
    want = where.out_shape(1)
    if tuple(alpha.shape) != want:
        padded = alpha.new_full(want, -math.inf)
        padded[..., :alpha.shape[-1]] = alpha
        alpha = padded
    return nll, alpha


def ctc_backward_signatures(ctx: Ctx) -> list:
    """(grad [N], log_probs [T, N, C], targets [N, S], lengths, nll, log_alpha) -> [T, N, C], split on N."""
    if len(ctx.shapes[1]) != 3 or len(ctx.shapes[2]) != 2:
        return []
    return [((S(0), S(1)) + (S(0),) * (len(ctx.shapes) - 2), (S(1),))]


def ctc_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    named = named_args(func, args, kwargs)
    start, size = where.in_box(1)[1]
    _cut_lengths(named, start, size)
    return func(*named.values())


# the .Tensor overloads (lengths as tensors) have no meta kernel: log_alpha's size is the longest target's,
# which only the lengths' values say, so they run replicated
register([aten._ctc_loss.default], Rule(ctc_signatures, kernel=ctc_local))
register([aten._ctc_loss_backward.default],
         Rule(ctc_backward_signatures, kernel=checked_like_input(ctc_backward_local), meta=like_input))


# -- linear_cross_entropy's chunked ops (torch_nn custom ops): the batch split ---------------------------
def chunked_signatures(ctx: Ctx) -> list:
    """(input [N, D], linear_weight [V, D], target [N], bias?, class weight?) -> (loss, grad_input,
    grad_linear_weight, grad_linear_bias), the gradients computed in the forward (empty where not
    asked). The batch split: the loss and the weight and bias gradients are sums over samples (P), the
    input's gradient split alike; 'mean' takes the target whole (the kernel divides by the global total
    weight). The classes cannot split (each row's softmax spans them), nor can D (logits would be P)."""
    if len(ctx.shapes[0]) != 2:
        return []
    mean = ctx.named("reduction") == "mean"
    ins = (S(0), B, B if mean else S(0)) + (B,) * (len(ctx.shapes) - 3)
    shapes = ctx.out_shapes
    outs = (P, S(0) if shapes[1] == ctx.shapes[0] else B, P if shapes[2] == ctx.shapes[1] else B,
            P if shapes[3] == ctx.shapes[1][:1] else B)
    return [(ins, outs)]


def chunked_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """'mean' over a split batch: the rows' 'sum' (loss and gradients) over the global total weight of the
    scored targets (what torch's chunked op folds into its per-row weights)."""
    named = named_args(func, args, kwargs)
    if named["reduction"] != "mean" or _whole(args, kwargs, where.ctx):
        return func(*args, **kwargs)
    full_target = named["target"]
    start, size = where.in_box(0)[0]
    named["target"], named["reduction"] = full_target.narrow(0, start, size), "sum"
    outs = func(*named.values())
    if where.checking:
        return outs
    total = global_total_weight(full_target, named["weight"], named["ignore_index"], outs[0].dtype)
    return tuple(o / total for o in outs)


def chunked_none_signatures(ctx: Ctx) -> list:
    """(input [N, D], linear_weight, target [N], bias?, class weight?) -> per-sample loss [N]: rows split."""
    if len(ctx.shapes[0]) != 2:
        return []
    return [((S(0), B, S(0)) + (B,) * (len(ctx.shapes) - 3), (S(0),))]


try:  # torch versions with linear_cross_entropy's chunked path define these ops in this module
    import torch.nn.modules.linear_cross_entropy  # noqa: F401
    register([torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default],
             Rule(chunked_signatures, kernel=chunked_local))
    register([torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default],
             Rule(chunked_none_signatures))
except (ImportError, AttributeError):
    pass
