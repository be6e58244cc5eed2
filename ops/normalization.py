"""Softmax, log-softmax and layer norm (+ backward): any dim but the normalised ones may be split.

A softmax over a split dim (vocab-parallel logits) is decomposed into its
reductions, each reduced across the split once: max and sum of exp forward,
the gradient's row sum backward, as [rows] all-reduces; the logits never move.

The backward kernels are linear in the incoming gradient, so a P gradient
passes through with the saved activations Broadcast. RMS norm has no kernel
of its own on CPU: it is pow/mean/rsqrt/mul, covered by the pointwise and
reduction rules.
"""
from __future__ import annotations

from .registry import B, Ctx, P, Rule, S, aten, overloads, reduce_partial, register, split_on


def softmax_signatures(ctx: Ctx) -> list:
    nd = len(ctx.shapes[0])
    dim = ctx.named("dim") % max(nd, 1)
    n = len(ctx.shapes)
    sigs = [((S(d),) * n, (S(d),)) for d in range(nd) if d != dim]
    if n == 2:  # backward: (grad, output) -> grad_input, linear in grad
        sigs.append(((P, B), (P,)))
    return sigs


def _dim_split(ctx: Ctx, layouts: tuple) -> bool:
    dim = ctx.named("dim") % max(len(ctx.shapes[0]), 1)
    return any(split_on(lay, dim) for lay in layouts)


def _split_softmax(func, args, kwargs):
    """(log_)softmax(x) over a split dim: x - max, exp, sum, each reduction made whole once."""
    x, dim = args[0], args[1] % max(args[0].dim(), 1)
    z = aten.sub.Tensor(x, reduce_partial(aten.amax.default(x, [dim], True)))
    total = reduce_partial(aten.sum.dim_IntList(aten.exp.default(z), [dim], True))
    if func == aten._log_softmax.default:
        return aten.sub.Tensor(z, aten.log.default(total))
    return aten.div.Tensor(aten.exp.default(z), total)


def _split_softmax_backward(func, args, kwargs):
    """log_softmax': g - exp(y) * sum(g); softmax': y * (g - sum(g * y)); the sum made whole once."""
    grad, out, dim = args[0], args[1], args[2] % max(args[1].dim(), 1)
    if func == aten._log_softmax_backward_data.default:
        total = reduce_partial(aten.sum.dim_IntList(grad, [dim], True))
        return aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(out), total))
    total = reduce_partial(aten.sum.dim_IntList(aten.mul.Tensor(grad, out), [dim], True))
    return aten.mul.Tensor(out, aten.sub.Tensor(grad, total))


register([aten._softmax.default, aten._log_softmax.default],
         Rule(softmax_signatures, decompose=_split_softmax, decompose_when=_dim_split))
# softmax that gives 0 on rows that are all -inf (SDPA's math path, taken with dropout or a mask): the
# decomposition above would give NaN there, so a split dim is taken whole
register(overloads("_safe_softmax"), Rule(softmax_signatures))
register([aten._softmax_backward_data.default, aten._log_softmax_backward_data.default],
         Rule(softmax_signatures, decompose=_split_softmax_backward, decompose_when=_dim_split))


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
