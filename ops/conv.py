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
- a spatial dim (not transposed): x S(2+i), w and b whole -> S(2+i), each rank computing its block of
  outputs from a window of x a little wider than its own rows, the rows beyond received from the ranks
  holding them (`ops/halo.py`, charged as `Rule.kernel_cost`); the backward exchanges the window again
  and sends the gradient rows of other ranks' rows back, the weight's and bias's gradients Partial. One
  spatial dim at a time: a window over two split dims would need its corners from diagonal ranks.
- Partial: linear in x (with the bias) and in w (with the bias).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..layout import Layout
from ..sbp import Split
from .arguments import named_args
from .halo import Window, gather_window, halo_cost, return_window
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
    if not tr:
        sigs += [sig(S(d), B, B, S(d)) for d in range(2, len(ctx.shapes[0]))]
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
    if not tr:
        sigs += [((S(d), S(d), B), (S(d), P, P)) for d in range(2, len(ctx.shapes[1]))]
    return sigs


def _window(ctx: Ctx, x: Layout, w_at: int) -> Optional[Window]:
    """The window along the spatial dim the input `x` is split on, if it is (see the module docstring)."""
    dims = {s.dim for s in x.sbp if isinstance(s, Split) and s.dim >= 2}
    if not dims:
        return None
    if len(dims) > 1 or ctx.named("transposed"):
        raise RuntimeError(f"convolution: an input split on spatial dims {sorted(dims)} "
                           f"{'of a transposed convolution ' if ctx.named('transposed') else ''}has no halo rule")
    d = dims.pop()

    def at(name: str) -> int:
        v = list(ctx.named(name))
        return int(v[d - 2] if len(v) > 1 else v[0])
    return Window(d, at("stride"), at("padding"), at("dilation") * (ctx.shapes[w_at][d] - 1))


def _unpadded(padding: Any, win: Window, spatial: int) -> list:
    """`padding` with none along the window's dim: the window holds that padding's zeros itself."""
    pad = list(padding) if len(padding) > 1 else list(padding) * spatial
    pad[win.dim - 2] = 0
    return pad


def conv_cost(backward: bool):
    """The halo exchange's traffic (`ops/halo.py`) where x is split on a spatial dim; None (not to be taken)
    where it is split on two, or a transposed convolution's is."""
    x_at, y_at = (1, 0) if backward else (0, None)

    def cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> Optional[tuple]:
        x = targets[x_at]
        dims = {s.dim for s in x.sbp if isinstance(s, Split) and s.dim >= 2}
        if not dims:
            return (), 0
        if len(dims) > 1 or ctx.named("transposed"):
            return None
        win = _window(ctx, x, x_at + 1)
        y, y_shape = (targets[0], ctx.shapes[0]) if backward else (out_layouts[0], ctx.out_shapes[0])
        return halo_cost(x, tuple(ctx.shapes[x_at]), y, tuple(y_shape), win, ctx.args[x_at].dtype.itemsize,
                         backward)
    return cost


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
    x, w, b, groups, tr, padding = a["input"], a["weight"], a["bias"], a["groups"], a["transposed"], a["padding"]
    win = _window(where.ctx, where.in_layouts[0], 1)
    if win is not None:
        ctx = where.ctx
        x = gather_window(x, where.in_layouts[0], tuple(ctx.shapes[0]), where.out_layouts[0], tuple(ctx.out_shapes[0]),
                          win, where.rank, where.checking)
        padding = _unpadded(padding, win, x.dim() - 2)
    out_shape = where.out_shape(0)
    if groups == 1:
        if x.shape[1] == 0 or w.numel() == 0 or 0 in out_shape:
            out = x.new_zeros(out_shape)
            if b is not None and out.numel():
                out = out + _channel_view(b, len(out_shape))
            return out
        return func(x, w, b, a["stride"], padding, a["dilation"], tr, a["output_padding"], groups)
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
    return func(x, w, b, a["stride"], padding, a["dilation"], tr, a["output_padding"], g1 - g0)


def conv_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """The backward on the shards (with `bias_sizes` this rank's, and `groups` its own where groups are
    split); an empty shard gives zero gradients of the shards' shapes and the bias gradient's sum. Over a
    spatial split: on the input's window, whose gradient rows go back to the ranks holding them."""
    a = named_args(func, args, kwargs)
    x, mask, ctx = a["input"], a["output_mask"], where.ctx
    win = _window(ctx, where.in_layouts[1], 2)
    if win is None:
        return _backward_on(func, a, x, a["padding"], where)
    x_shape = x.shape
    window = gather_window(x, where.in_layouts[1], tuple(ctx.shapes[1]), where.in_layouts[0], tuple(ctx.shapes[0]),
                           win, where.rank, where.checking)
    gx, gw, gb = _backward_on(func, a, window, _unpadded(a["padding"], win, x.dim() - 2), where)
    if mask[0]:
        gx = return_window(gx, x_shape, where.in_layouts[1], tuple(ctx.shapes[1]), where.in_layouts[0],
                           tuple(ctx.shapes[0]), win, where.rank, where.checking)
    return gx, gw, gb


def _backward_on(func: Any, a: dict, x: torch.Tensor, padding: Any, where: ShardSite) -> tuple:
    g, w, groups, mask = a["grad_output"], a["weight"], a["groups"], a["output_mask"]
    bias_sizes = None if a["bias_sizes"] is None else [g.shape[1]]
    if groups == 1:
        if g.numel() == 0 or x.numel() == 0 or w.numel() == 0:
            return (x.new_zeros(x.shape) if mask[0] else None,
                    w.new_zeros(where.out_shape(1)) if mask[1] else None,
                    g.sum([0] + list(range(2, g.dim()))) if mask[2] else None)
        return func(g, x, w, bias_sizes, a["stride"], padding, a["dilation"], a["transposed"],
                    a["output_padding"], groups, mask)
    cin, cout = where.ctx.shapes[1][1], where.ctx.shapes[0][1]
    g0, g1 = _groups_held(where, groups, a["transposed"], cin, cout)
    if (_range(where.in_box(1)[1]) != (g0 * (cin // groups), g1 * (cin // groups)) or
            _range(where.in_box(0)[1]) != (g0 * (cout // groups), g1 * (cout // groups))):
        raise RuntimeError("convolution_backward: channels and weight not split alike in whole groups")
    if g0 == g1 or g.numel() == 0 or x.numel() == 0:
        return (x.new_zeros(x.shape) if mask[0] else None,
                w.new_zeros(where.out_shape(1)) if mask[1] else None,
                g.sum([0] + list(range(2, g.dim()))) if mask[2] else None)
    return func(g, x, w, bias_sizes, a["stride"], padding, a["dilation"], a["transposed"],
                a["output_padding"], g1 - g0, mask)


def _plain(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    """The kernel is the plain op on the shards unless it exchanges a halo (the input split on a spatial
    dim) or runs a rank's share of the groups (a split of the input's channels or of the weight's
    group-major dim 0)."""
    x, w = (ins[1], ins[2]) if ctx.func == aten.convolution_backward.default else (ins[0], ins[1])
    if any(isinstance(s, Split) and s.dim >= 2 for s in x.sbp):
        return False
    if int(ctx.named("groups")) == 1:
        return True
    return not any(isinstance(s, Split) and s.dim == d for lay, d in ((x, 1), (w, 0)) for s in lay.sbp)


register([aten.convolution.default],
         Rule(conv_signatures, kernel=conv_local, kernel_cost=conv_cost(False), plain_when=_plain))
register([aten.convolution_backward.default],
         Rule(conv_backward_signatures, kernel=conv_backward_local, kernel_cost=conv_cost(True), plain_when=_plain))
