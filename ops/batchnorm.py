"""Batch norm: statistics are reductions over the batch (and spatial) dims, which may be split.

Evaluation normalises with the running statistics, elementwise per channel: any split passes, and a
channel split takes the per-channel tensors split alike. Training computes the batch statistics, so
it is decomposed: mean and biased variance over every dim but the channel dim, each made whole once
(a [channels]-sized all-reduce when the batch is split; nothing when channels are split), then the
running statistics updated in place where they live (unbiased variance, as torch), so every rank
keeps the same running statistics as one device. The backward is decomposed the same way: two
per-channel sums (the weight and bias gradients), made whole together in one collective when the batch
is split (SyncBatchNorm's backward all-reduce: the input's gradient reads both), and an elementwise
gradient of the input. Per layer two [C] all-reduces forward (mean, then the centred variance: two passes,
as one device's kernel, where SyncBatchNorm's one all-gather of each rank's mean and invstd combines them)
and one [2, C] backward.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from .arguments import named_args
from .registry import B, Ctx, Rule, S, ShardSite, aten, reduce_partial, register


def _channel_view(t: Any, nd: int) -> Any:
    """A per-channel [C] tensor viewed to broadcast against an [N, C, ...] input."""
    return aten.view.default(t, [1, -1] + [1] * (nd - 2))


def _stat_dims(nd: int) -> list[int]:
    return [0] + list(range(2, nd))


def eval_signatures(ctx: Ctx) -> list:
    """(input, weight?, bias?, running_mean?, running_var?) -> (out, save_mean, save_invstd); eval only."""
    if ctx.named("training"):
        return []
    n_extra = len(ctx.shapes) - 1
    nd = len(ctx.shapes[0])
    sigs = [((S(d),) + (B,) * n_extra, (S(d), B, B)) for d in range(nd) if d != 1]
    if nd > 1:
        sigs.append(((S(1),) + (S(0),) * n_extra, (S(1), S(0), S(0))))
    return sigs


def training(ctx: Ctx, layouts: tuple) -> bool:
    return bool(ctx.named("training"))


def batch_norm_train(func: Any, args: tuple, kwargs: dict) -> tuple:
    """Batch statistics as two whole reductions; running statistics updated in place; (out, mean, invstd)."""
    a = named_args(func, args, kwargs)
    x, w, b, rm, rv = a["input"], a["weight"], a["bias"], a["running_mean"], a["running_var"]
    nd, dims = x.dim(), _stat_dims(x.dim())
    n = math.prod(x.shape[d] for d in dims)
    mean = _whole(aten.sum.dim_IntList(x, dims), n)
    centred = aten.sub.Tensor(x, _channel_view(mean, nd))
    var = _whole(aten.sum.dim_IntList(aten.pow.Tensor_Scalar(centred, 2), dims), n)
    invstd = aten.rsqrt.default(aten.add.Scalar(var, a["eps"]))
    out = aten.mul.Tensor(centred, _channel_view(invstd, nd))
    if w is not None:
        out = aten.mul.Tensor(out, _channel_view(w, nd))
    if b is not None:
        out = aten.add.Tensor(out, _channel_view(b, nd))
    m = a["momentum"]
    if rm is not None:
        aten.add_.Tensor(aten.mul_.Scalar(rm, 1 - m), mean, alpha=m)
    if rv is not None:
        aten.add_.Tensor(aten.mul_.Scalar(rv, 1 - m), var, alpha=m * n / max(n - 1, 1))
    return out, mean, invstd


def _whole(total: Any, n: int) -> Any:
    """A per-channel sum over the statistics' dims, made whole now (one all-reduce of [C] where the batch is
    split) and divided by the elements it sums: the statistic every rank normalises with. Reduced here, not
    left Partial for its readers to choose, which reduced the same statistic again for the running statistics'
    update and the normalisation (5 collectives a layer where SyncBatchNorm makes one)."""
    return aten.div.Scalar(reduce_partial(total), n)


def batch_norm_backward(func: Any, args: tuple, kwargs: dict) -> tuple:
    """dx = w·invstd·(g - mean(g) - x̂·mean(g·x̂)) in training (w·invstd·g in eval); dw = Σ g·x̂; db = Σ g."""
    a = named_args(func, args, kwargs)
    g, x, w, mask = a["grad_out"], a["input"], a["weight"], a["output_mask"]
    nd, dims = x.dim(), _stat_dims(x.dim())
    n = math.prod(x.shape[d] for d in dims)
    if a["train"]:
        mean, invstd = a["save_mean"], a["save_invstd"]
    else:
        mean, invstd = a["running_mean"], aten.rsqrt.default(aten.add.Scalar(a["running_var"], a["eps"]))
    xhat = aten.mul.Tensor(aten.sub.Tensor(x, _channel_view(mean, nd)), _channel_view(invstd, nd))
    scale = invstd if w is None else aten.mul.Tensor(invstd, w)
    grad_b = aten.sum.dim_IntList(g, dims) if (mask[2] or a["train"]) else None
    grad_w = aten.sum.dim_IntList(aten.mul.Tensor(g, xhat), dims) if (mask[1] or a["train"]) else None
    if a["train"]:  # both sums whole in one collective (SyncBatchNorm's backward all-reduce): dx reads them
        both = reduce_partial(aten.stack.default([grad_b, grad_w]))
        grad_b, grad_w = aten.select.int(both, 0, 0), aten.select.int(both, 0, 1)
    grad_x: Optional[Any] = None
    if mask[0]:
        if a["train"]:
            centred = aten.sub.Tensor(g, _channel_view(aten.div.Scalar(grad_b, n), nd))
            centred = aten.sub.Tensor(centred, aten.mul.Tensor(xhat, _channel_view(aten.div.Scalar(grad_w, n), nd)))
            grad_x = aten.mul.Tensor(centred, _channel_view(scale, nd))
        else:
            grad_x = aten.mul.Tensor(g, _channel_view(scale, nd))
    return grad_x, _as_parameter(grad_w, w) if mask[1] else None, _as_parameter(grad_b, w) if mask[2] else None


def _as_parameter(grad: Any, weight: Any) -> Any:
    """A [C] gradient laid out as the weight is (the bias is laid out alike by every plan we know), Partial
    reduced: [C] is small, and a Partial gradient of a parameter laid out otherwise was accumulated into
    different layouts on different ranks on the simulator's first (cache-missing) call (the refcount-
    dependent steal-or-copy of autograd's accumulation; see the report of issue 17)."""
    if not hasattr(weight, "_layout") or weight._layout.has_partial:
        return reduce_partial(grad)
    return grad.to_global(weight.placement, weight.sbp)


def eval_meta(func: Any, args: tuple, kwargs: dict) -> tuple:
    """The op on meta, with eval's saved statistics empty ([0]) as the CPU kernel gives them (torch's meta
    kernel says [C]); nothing reads them (the eval backward uses the running statistics)."""
    out = func(*args, **kwargs)
    if not named_args(func, args, kwargs).get("training", False):
        out = (out[0],) + tuple(o.new_empty((0,)) for o in out[1:3]) + tuple(out[3:])
    return out


def eval_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> tuple:
    """The op on the shards, its eval statistics as `eval_meta` says (a kernel that gives [C] ones: emptied)."""
    out = func(*args, **kwargs)
    return (out[0],) + tuple(o if tuple(o.shape) == where.out_shape(i + 1) else o.new_empty(where.out_shape(i + 1))
                             for i, o in enumerate(out[1:3])) + tuple(out[3:])


def _cpu(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    """On CPU `eval_local` is the op itself (its eval statistics are already empty)."""
    return ins[0].placement.device_type == "cpu"


EVAL = dict(meta=eval_meta, kernel=eval_local, plain_when=_cpu)
register([aten.native_batch_norm.default], Rule(eval_signatures, decompose=batch_norm_train,
                                                 decompose_when=training, **EVAL))
register([aten.native_batch_norm_backward.default], Rule(lambda ctx: [], decompose=batch_norm_backward))
