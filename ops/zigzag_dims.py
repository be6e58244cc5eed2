"""Which dim of each operand and result of an op runs along a zigzag dim (`ops/zigzag.py`).

An op can run on the zigzag reading (dim d in zigzag order, read as a split) when permuting d's rows
permutes, the same way, one dim of every operand and result that has them, and leaves the others
alone: pointwise ops, views that keep d one dim, transposes, row-wise kernels (layer norm, softmax
over another dim), matrix products (rows, or the contracted dim on both sides), embedding lookups,
the loss over rows, reductions. `align(func, args, kwargs, shapes, ref, d)` says, for such an op,
each tensor operand's dim (in `map_tensors` order; None: it has none) and each result's, given that
operand `ref` is zigzag on `d`; None for every other op or call (the caller boxes to a contiguous
split). A wrong entry here would give wrong values, so each is the op's documented shape algebra.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from .pointwise import LINEAR, NONLINEAR_OPS, _ops
from .registry import aten

Alignment = tuple[list, Callable[[list], list]]  # (per operand, results -> per result)

SAME_ROWS = frozenset(op for names in LINEAR for op in _ops(*names)) | frozenset(_ops(*NONLINEAR_OPS)) | {
    aten._to_copy.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default}


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _pointwise(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    """Broadcasting aligns dims from the right."""
    out_ndim = max(len(s) for s in shapes)
    token = d + out_ndim - len(shapes[ref])
    ins = [token - (out_ndim - len(s)) if token - (out_ndim - len(s)) >= 0 else None for s in shapes]
    return ins, lambda outs: [token if o.ndim == out_ndim else None for o in outs]


def _view(func, args, kwargs, shapes, ref, d, pieces_for) -> Optional[Alignment]:
    """A view keeps the reading when d's rows stay in one dim in their order, in whole pieces of the
    reading: d kept (the same elements before it), d merged with the dims just before it (a flattened
    [batch, seq]: the pieces repeat per batch row), or d split with its last dim holding whole pieces."""
    if ref != 0:
        return None
    shape, size = shapes[0], list(args[1])
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = math.prod(shape) // known if known else 0
    for j, n in enumerate(size):
        before = math.prod(size[:j])
        merged = any(n == math.prod(shape[k:d + 1]) and before == math.prod(shape[:k]) for k in range(d + 1))
        split = any(math.prod(size[j0:j + 1]) == shape[d] and math.prod(size[:j0]) == math.prod(shape[:d])
                    for j0 in range(j + 1))
        if (merged or split) and (n == shape[d] or pieces_for(n) is not None):
            return [d], lambda outs, j=j: [j]
    return None


def _transpose(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    ndim = len(shapes[0])
    if func is aten.t.default:
        perm = list(range(ndim))[::-1]
    elif func is aten.permute.default:
        perm = [p % ndim for p in args[1]]
    else:
        a, b = args[1] % ndim, args[2] % ndim
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
    return [d], lambda outs: [perm.index(d)]


def _unsqueeze(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    at = args[1] % (len(shapes[0]) + 1)
    return [d], lambda outs: [d + (at <= d)]


def _mm(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    """mm(a, b) / addmm(bias, a, b): a's rows are the result's rows; a's columns and b's rows are
    contracted (the result has no such dim); b's columns are the result's columns."""
    off = 1 if func is aten.addmm.default else 0
    side, dim = (ref - off, d)
    if side < 0:
        return None  # the bias is broadcast over the rows: it is never the reference
    if (side, dim) == (0, 0):
        a, b, out = 0, None, 0
    elif (side, dim) in ((0, 1), (1, 0)):
        a, b, out = 1, 0, None
    else:
        a, b, out = None, 1, 1
    bias = [] if not off else [None if out is None else out - (2 - len(shapes[0]))
                               if out - (2 - len(shapes[0])) >= 0 else None]
    return bias + [a, b], lambda outs: [out]


def _rowwise(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    """Kernels that work along other dims: layer norm (over its last dims), softmax (over `dim`)."""
    if func is aten.native_layer_norm.default:
        if ref != 0 or d >= len(shapes[0]) - len(args[1]):
            return None
        return [d] + [None] * (len(shapes) - 1), lambda outs: [d, d, d]
    if func is aten.native_layer_norm_backward.default:
        if ref not in (0, 1, 2, 3) or d >= len(shapes[1]) - len(args[2]):
            return None  # grad_out, input, mean, rstd have d; weight and bias do not
        return [d] * 4 + [None] * (len(shapes) - 4), lambda outs: [d, None, None]
    dim = args[1] if func in (aten._softmax.default, aten._log_softmax.default) else args[2]
    if dim % len(shapes[0]) == d:
        return None
    return [d] * len(shapes), lambda outs: [d]


def _embedding(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    if func is aten.embedding.default:  # (weight, indices): the result is indices' shape + [dim]
        return ([None, d], lambda outs: [d]) if ref == 1 else None
    # embedding_dense_backward(grad_output, indices, ...): rows summed into the weight's gradient
    if ref == 1 or (ref == 0 and d < len(shapes[1])):
        return [d, d], lambda outs: [None]
    return None


def _nll(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    """The loss over rows [N, C] with targets [N]: reduced (mean, sum), the row order does not matter."""
    backward = func is aten.nll_loss_backward.default
    s, t = (1, 2) if backward else (0, 1)
    if len(shapes[s]) != 2 or d != 0 or ref not in (s, t) + ((0,) if backward else ()):
        return None
    reduction = _arg(args, kwargs, 4 if backward else 3, "reduction", 1)
    if backward and ref == 0 and reduction != 0:
        return None
    ins = [None] * len(shapes)
    ins[s] = ins[t] = 0
    if backward:
        ins[0] = 0 if reduction == 0 else None
        return ins, lambda outs: [0]
    return ins, lambda outs: [0 if reduction == 0 else None, None]


def _reduce(func, args, kwargs, shapes, ref, d) -> Optional[Alignment]:
    """sum/mean: over d (the order does not matter), or over other dims (d moves left past them)."""
    ndim = len(shapes[0])
    dims = _arg(args, kwargs, 1, "dim")
    if func in (aten.sum.default, aten.mean.default) or not dims:
        return [d], lambda outs: [None]
    dims = [x % ndim for x in ([dims] if isinstance(dims, int) else dims)]
    if d in dims:
        return [d], lambda outs: [None]
    keep = _arg(args, kwargs, 2, "keepdim", False)
    return [d], lambda outs: [d if keep else d - sum(x < d for x in dims)]


ALIGN: dict = {op: _pointwise for op in SAME_ROWS}
ALIGN.update({aten.view.default: _view, aten._unsafe_view.default: _view,
              aten.transpose.int: _transpose, aten.t.default: _transpose, aten.permute.default: _transpose,
              aten.unsqueeze.default: _unsqueeze,
              aten.mm.default: _mm, aten.addmm.default: _mm,
              aten.native_layer_norm.default: _rowwise, aten.native_layer_norm_backward.default: _rowwise,
              aten._softmax.default: _rowwise, aten._log_softmax.default: _rowwise,
              aten._softmax_backward_data.default: _rowwise, aten._log_softmax_backward_data.default: _rowwise,
              aten.embedding.default: _embedding, aten.embedding_dense_backward.default: _embedding,
              aten.nll_loss_forward.default: _nll, aten.nll_loss_backward.default: _nll,
              aten.sum.default: _reduce, aten.mean.default: _reduce, aten.sum.dim_IntList: _reduce,
              aten.mean.dim: _reduce})


def align(func: Any, args: tuple, kwargs: dict, shapes: list, ref: int, d: int,
          pieces_for: Callable[[int], Any]) -> Optional[Alignment]:
    """`pieces_for(length)`: how the reading orders a dim of that length (None: it cannot), which a view
    that changes d's length must keep."""
    rule = ALIGN.get(func)
    if rule is None:
        return None
    return rule(func, args, kwargs, shapes, ref, d, pieces_for) if rule is _view else \
        rule(func, args, kwargs, shapes, ref, d)


__all__ = ["align", "ALIGN", "SAME_ROWS"]
