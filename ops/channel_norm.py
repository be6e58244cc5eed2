"""Group norm (+ backward), and batch norm's other aten forms (the rules of ops/batchnorm.py).

Group norm normalises each sample's groups of channels over their channels and spatial dims: the batch
may be split (the statistics [N, G] split alike; the weight and bias gradients are then each rank's
samples' share: Partial), and so may the channels where each rank holds whole groups, the statistics
then split on their group dim (the kernel runs the rank's groups with `group` their count, and checks
that its channels, its groups and its statistics line up; a split that cuts a group is not valid, and
the batch split or a gather is taken instead). `N` and `C` in the arguments are global: the kernels take
this rank's. The backward is linear in the incoming gradient, so a Partial one passes.

`_native_batch_norm_legit` and `_batch_norm_with_update` are `native_batch_norm` under other names
(training: decomposed into whole reductions of the batch statistics; eval: elementwise per channel);
`batch_norm_backward` is `native_batch_norm_backward` with `update` for `train`.
"""
from __future__ import annotations

from typing import Any

import torch

from .arguments import named_args
from .batchnorm import EVAL, batch_norm_backward as native_backward, batch_norm_train, eval_signatures, training
from .registry import B, Ctx, P, Rule, S, ShardSite, aten, register
from .spatial import empty_safe


def group_norm_signatures(ctx: Ctx) -> list:
    """(x, [weight], [bias]) -> (out, mean [N, G], rstd [N, G])."""
    extra = len(ctx.shapes) - 1
    return [((S(0),) + (B,) * extra, (S(0),) * 3), ((S(1),) + (S(0),) * extra, (S(1),) * 3)]


def group_norm_backward_signatures(ctx: Ctx) -> list:
    """(grad, x, mean, rstd, [weight]) -> (grad_x, grad_weight, grad_bias)."""
    extra = len(ctx.shapes) - 4
    return [((S(0),) * 4 + (B,) * extra, (S(0), P, P)), ((S(1),) * 4 + (S(0),) * extra, (S(1), S(0), S(0))),
            ((P, B, B, B) + (B,) * extra, (P, P, P))]


def _local_groups(where: ShardSite, x: torch.Tensor, x_slot: int, stats_slot: int, stats_out: bool) -> int:
    """This rank's count of groups: its channels in whole groups, its statistics the same groups."""
    c, groups = where.ctx.shapes[x_slot][1], int(where.ctx.named("group"))
    per = c // groups
    start, size = where.in_box(x_slot)[1]
    g_start, g_size = where.out_box(stats_slot)[1] if stats_out else where.in_box(stats_slot)[1]
    if start % per or size % per or (start // per, size // per) != (g_start, g_size):
        raise RuntimeError(f"group norm: this rank's channels [{start}, {start + size}) are not its groups "
                           f"[{g_start}, {g_start + g_size}) of {per} channels")
    return size // per


def group_norm_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    a = named_args(func, args, kwargs)
    x = a["input"].contiguous()  # a slice of a Broadcast input may not be (torch's kernel asks it)
    groups = _local_groups(where, x, 0, 1, True)
    return func(x, a["weight"], a["bias"], x.shape[0], x.shape[1], a["HxW"], groups, a["eps"])


def group_norm_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """An empty shard (no samples, or no channels, here) gives zero gradients of the shards' shapes."""
    a = named_args(func, args, kwargs)
    x, mask = a["input"], a["output_mask"]
    groups = _local_groups(where, x, 1, 2, False)
    if x.numel() == 0:
        return tuple(x.new_zeros(where.out_shape(i)) if mask[i] else None for i in range(3))
    return func(a["grad_out"].contiguous(), x.contiguous(), a["mean"].contiguous(), a["rstd"].contiguous(),
                a["weight"], x.shape[0], x.shape[1], a["HxW"], groups,
                mask)


def _no_group_split(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    """The kernel computes the plain op on the shards unless it runs a rank's share of the groups."""
    x = ins[1] if ctx.func == aten.native_group_norm_backward.default else ins[0]
    return not any(s == S(1) for s in x.sbp)


register([aten.native_group_norm.default],
         Rule(group_norm_signatures, kernel=empty_safe(group_norm_local), plain_when=_no_group_split))
register([aten.native_group_norm_backward.default],
         Rule(group_norm_backward_signatures, kernel=group_norm_backward_local, plain_when=_no_group_split))


# -- batch norm's other names --------------------------------------------------------------------------
def legit_no_stats_train(func: Any, args: tuple, kwargs: dict) -> tuple:
    a = named_args(func, args, kwargs)
    return batch_norm_train(aten.native_batch_norm.default,
                            (a["input"], a["weight"], a["bias"], None, None, True, a["momentum"], a["eps"]), {})


def with_update(func: Any, args: tuple, kwargs: dict) -> tuple:
    """Training batch norm, and its `reserve` (an empty byte tensor on CPU, as torch gives)."""
    a = named_args(func, args, kwargs)
    out, mean, invstd = batch_norm_train(aten.native_batch_norm.default,
                                         (a["input"], a["weight"], a["bias"], a["running_mean"], a["running_var"],
                                          True, a["momentum"], a["eps"]), {})
    return out, mean, invstd, aten.new_empty.default(mean, [0], dtype=torch.uint8)


def update_backward(func: Any, args: tuple, kwargs: dict) -> tuple:
    a = named_args(func, args, kwargs)
    return native_backward(aten.native_batch_norm_backward.default,
                           (a["grad_out"], a["input"], a["weight"], a["running_mean"], a["running_var"],
                            a["save_mean"], a["save_var"], a["update"], a["eps"], a["output_mask"]), {})


def no_update_signatures(ctx: Ctx) -> list:
    """Eval batch norm with its empty statistics and reserve: elementwise per channel."""
    return [(ins, outs + (B,)) for ins, outs in eval_signatures(ctx)]


register([aten._native_batch_norm_legit.default],
         Rule(eval_signatures, decompose=batch_norm_train, decompose_when=training, **EVAL))
register([aten._native_batch_norm_legit.no_stats],
         Rule(eval_signatures, decompose=legit_no_stats_train, decompose_when=training, **EVAL))
register([aten._native_batch_norm_legit_no_training.default], Rule(eval_signatures, **EVAL))
register([aten._batch_norm_with_update.default], Rule(lambda ctx: [], decompose=with_update))
register([aten._batch_norm_no_update.default], Rule(no_update_signatures, **EVAL))
register([aten.batch_norm_backward.default], Rule(lambda ctx: [], decompose=update_backward))
