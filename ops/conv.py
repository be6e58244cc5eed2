"""Convolution (+ backward): the batch, the output channels, the input channels, or whole groups split.

`convolution(x [N, Cin, *], w, b?)` with w [Cout, Cin/G, *k] (transposed: [Cin, Cout/G, *k]):

- batch: x S(0), w and b whole -> S(0); the backward's weight and bias gradients are each rank's
  samples' share: Partial (the data-parallel all-reduce);
- output channels (G = 1; a column-parallel conv): x whole, w split on its Cout dim, b S(0) -> S(1);
  the input gradient is each rank's channels' share: Partial;
- input channels (G = 1; a row-parallel conv): x S(1), w split on its Cin dim -> Partial, the sum over
  the input channels being cut. The bias is taken Partial too (Broadcast -> Partial keeps it on one rank,
  zeros elsewhere: nothing moves), so the ranks' outputs add up to one bias, not n;
- whole groups (G > 1, depthwise): x S(1), w S(0), b S(0) -> S(1), where each rank's channels are whole
  groups; the kernel runs the rank's groups with `groups` = their count (`conv_local` checks the
  alignment, so a split that cuts a group is not valid and another choice is taken);
- Partial: linear in x (with the bias) and in w (with the bias).
"""
from __future__ import annotations

from typing import Any

import torch

from ..sbp import Split
from .arguments import named_args
from .registry import B, Ctx, P, Rule, S, ShardSite, aten, register


def _conv_args(ctx: Ctx) -> tuple[bool, int]:
    return bool(ctx.named("transposed")), int(ctx.named("groups"))


def conv_signatures(ctx: Ctx) -> list:
    """(x, w, [b]) -> y; see the module docstring."""
    tr, groups = _conv_args(ctx)
    has_bias = len(ctx.shapes) == 3
    w_out, w_in = (1, 0) if tr else (0, 1)  # the weight's dims of output and input channels

    def sig(x, w, b, y):
        return ((x, w, b) if has_bias else (x, w)), (y,)
    sigs = [sig(S(0), B, B, S(0)), sig(P, B, P, P), sig(B, P, P, P)]
    if groups == 1:
        sigs += [sig(B, S(w_out), S(0), S(1)), sig(S(1), S(w_in), P, P)]
    else:
        sigs += [sig(S(1), S(0), S(0), S(1)), sig(B, S(0), S(0), S(1))]
    return sigs


def conv_backward_signatures(ctx: Ctx) -> list:
    """(grad_y, x, w) -> (grad_x, grad_w, grad_b)."""
    tr, groups = _conv_args(ctx)
    w_out, w_in = (1, 0) if tr else (0, 1)
    sigs = [((S(0), S(0), B), (S(0), P, P)),
            ((P, B, B), (P, P, P)), ((B, P, B), (B, P, B)), ((B, B, P), (P, B, B))]
    if groups == 1:
        sigs += [((S(1), B, S(w_out)), (P, S(w_out), S(0))), ((B, S(1), S(w_in)), (S(1), S(w_in), B))]
    else:
        sigs.append(((S(1), S(1), S(0)), (S(1), S(0), S(0))))
    return sigs


def _channel_view(b: torch.Tensor, nd: int) -> torch.Tensor:
    return b.view([1, -1] + [1] * (nd - 2))


def _range(box: tuple[int, int]) -> tuple[int, int]:
    """A shard's (start, size) on one dim as [start, end)."""
    return box[0], box[0] + box[1]


def _groups_held(where: ShardSite, groups: int, transposed: bool, cin: int, cout: int) -> tuple[int, int]:
    """[g0, g1): the groups this rank's weight shard holds (its dim 0 is group-major), checked to be whole
    groups and to match the input channels it holds (whole: then sliced by the caller)."""
    per = (cin if transposed else cout) // groups
    lo, hi = _range(where.in_box(2 if where.ctx.func == aten.convolution_backward.default else 1)[0])
    if lo % per or hi % per:
        raise RuntimeError(f"convolution: this rank's channels [{lo}, {hi}) cut a group of {per}: not a split in "
                           "whole groups")
    return lo // per, hi // per


def conv_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """The op on the shards; with groups split, on this rank's groups (x sliced to them where whole); an
    empty shard of the channels contracted gives zeros (plus the rank's part of a Partial bias)."""
    a = named_args(func, args, kwargs)
    x, w, b, groups, tr = a["input"], a["weight"], a["bias"], a["groups"], a["transposed"]
    out_shape = where.out_shape(0)
    if groups == 1:
        if x.shape[1] == 0 or w.numel() == 0 or 0 in out_shape:
            out = x.new_zeros(out_shape)
            if b is not None and out.numel():
                out = out + _channel_view(b, len(out_shape))
            return out
        return func(*args, **kwargs)
    cin, cout = where.ctx.shapes[0][1], where.ctx.out_shapes[0][1]
    g0, g1 = _groups_held(where, groups, tr, cin, cout)
    if g0 == g1 or 0 in out_shape:
        return x.new_zeros(out_shape)
    per_in = cin // groups
    x_box = _range(where.in_box(0)[1])
    if x_box == (0, cin):
        x = x.narrow(1, g0 * per_in, (g1 - g0) * per_in)
    elif x_box != (g0 * per_in, g1 * per_in):
        raise RuntimeError("convolution: input channels and weight not split alike in whole groups")
    per_out = cout // groups
    if _range(where.out_box(0)[1]) != (g0 * per_out, g1 * per_out):
        raise RuntimeError("convolution: output channels and weight not split alike in whole groups")
    return func(x, w, b, a["stride"], a["padding"], a["dilation"], tr, a["output_padding"], g1 - g0)


def conv_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """The backward on the shards (with `bias_sizes` this rank's, and `groups` its own where groups are
    split); an empty shard gives zero gradients of the shards' shapes and the bias gradient's sum."""
    a = named_args(func, args, kwargs)
    g, x, w, groups, mask = a["grad_output"], a["input"], a["weight"], a["groups"], a["output_mask"]
    bias_sizes = None if a["bias_sizes"] is None else [g.shape[1]]
    if groups == 1:
        if g.numel() == 0 or x.numel() == 0 or w.numel() == 0:
            return (x.new_zeros(where.out_shape(0)) if mask[0] else None,
                    w.new_zeros(where.out_shape(1)) if mask[1] else None,
                    g.sum([0] + list(range(2, g.dim()))) if mask[2] else None)
        return func(g, x, w, bias_sizes, a["stride"], a["padding"], a["dilation"], a["transposed"],
                    a["output_padding"], groups, mask)
    cin, cout = where.ctx.shapes[1][1], where.ctx.shapes[0][1]
    g0, g1 = _groups_held(where, groups, a["transposed"], cin, cout)
    if (_range(where.in_box(1)[1]) != (g0 * (cin // groups), g1 * (cin // groups)) or
            _range(where.in_box(0)[1]) != (g0 * (cout // groups), g1 * (cout // groups))):
        raise RuntimeError("convolution_backward: channels and weight not split alike in whole groups")
    if g0 == g1 or g.numel() == 0 or x.numel() == 0:
        return (x.new_zeros(where.out_shape(0)) if mask[0] else None,
                w.new_zeros(where.out_shape(1)) if mask[1] else None,
                g.sum([0] + list(range(2, g.dim()))) if mask[2] else None)
    return func(g, x, w, bias_sizes, a["stride"], a["padding"], a["dilation"], a["transposed"],
                a["output_padding"], g1 - g0, mask)


def _groups_whole(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    """The kernel is the plain op on the shards unless it runs a rank's share of the groups (a split of the
    input's channels or of the weight's group-major dim 0)."""
    if int(ctx.named("groups")) == 1:
        return True
    x, w = (ins[1], ins[2]) if ctx.func == aten.convolution_backward.default else (ins[0], ins[1])
    return not any(isinstance(s, Split) and s.dim == d for lay, d in ((x, 1), (w, 0)) for s in lay.sbp)


register([aten.convolution.default], Rule(conv_signatures, kernel=conv_local, plain_when=_groups_whole))
register([aten.convolution_backward.default],
         Rule(conv_backward_signatures, kernel=conv_backward_local, plain_when=_groups_whole))
