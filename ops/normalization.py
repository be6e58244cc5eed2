"""Softmax, log-softmax and layer norm (+ backward): any dim but the normalised ones may be split.

The backward kernels are linear in the incoming gradient, so a P gradient
passes through with the saved activations Broadcast. RMS norm has no kernel
of its own on CPU: it is pow/mean/rsqrt/mul, covered by the pointwise and
reduction rules.
"""
from __future__ import annotations

from .registry import B, Ctx, P, Rule, S, aten, register


def softmax_signatures(ctx: Ctx) -> list:
    nd = len(ctx.shapes[0])
    dim = ctx.named("dim") % max(nd, 1)
    n = len(ctx.shapes)
    sigs = [((S(d),) * n, (S(d),)) for d in range(nd) if d != dim]
    if n == 2:  # backward: (grad, output) -> grad_input, linear in grad
        sigs.append(((P, B), (P,)))
    return sigs


register([aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
          aten._log_softmax_backward_data.default], Rule(softmax_signatures))


def _batch_dims(ctx: Ctx, x: int, norm_arg: int) -> range:
    return range(len(ctx.shapes[x]) - len(ctx.arg(norm_arg, "normalized_shape")))


def layer_norm_signatures(ctx: Ctx) -> list:
    """(x, [weight], [bias]) -> (out, mean, rstd): batch dims split, affine parameters Broadcast."""
    extra = (B,) * (len(ctx.shapes) - 1)
    return [((S(d),) + extra, (S(d),) * 3) for d in _batch_dims(ctx, 0, 1)]


def layer_norm_backward_signatures(ctx: Ctx) -> list:
    """(grad, x, mean, rstd, [weight], [bias]) -> (grad_x, grad_w, grad_b)."""
    extra = (B,) * (len(ctx.shapes) - 4)
    sigs = [((S(d),) * 4 + extra, (S(d), P, P)) for d in _batch_dims(ctx, 1, 2)]
    sigs.append(((P, B, B, B) + extra, (P, P, P)))
    return sigs


register([aten.native_layer_norm.default], Rule(layer_norm_signatures))
register([aten.native_layer_norm_backward.default], Rule(layer_norm_backward_signatures))
