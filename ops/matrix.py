"""Matrix products: the classic SBP table (DESIGN.md's `mm`), batched forms, and bias-added forms.

`matmul`/`linear` are composite in aten: autograd already lowers them to
mm/bmm/addmm plus views, so their rules are these plus the view rules.
"""
from __future__ import annotations

from typing import Any

import torch

from .registry import B, Ctx, P, Rule, S, aten, pointwise_dims, register


def mm_signatures(ctx: Ctx) -> list:
    """a [m,k] @ b [k,n]: rows, columns, the contracted dim (-> P), and P through either factor."""
    return [((S(0), B), (S(0),)), ((B, S(1)), (S(1),)), ((S(1), S(0)), (P,)),
            ((P, B), (P,)), ((B, P), (P,))]


def bmm_signatures(ctx: Ctx) -> list:
    return [((S(0), S(0)), (S(0),)), ((S(1), B), (S(1),)), ((B, S(2)), (S(2),)),
            ((S(2), S(1)), (P,)), ((P, B), (P,)), ((B, P), (P,))]


def with_bias(product) -> callable:
    """addmm/baddbmm: out = beta*bias + alpha*(a@b); the bias follows the output (broadcast), P with P."""
    def signatures(ctx: Ctx) -> list:
        out = ctx.out_shapes[0]
        sigs = []
        for (a, b), (o,) in product(ctx):
            bias = P if o == P else (B if o == B else pointwise_dims(ctx.shapes[0], out, o.dim))
            sigs.append(((bias, a, b), (o,)))
        return sigs
    return signatures


def product_meta(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """[.., m, k] @ [.., k, n] -> [.., m, n] on meta tensors, checked as torch's (Python) meta kernels check it.

    addmm/baddbmm's bias comes first and must broadcast to the product. Mixed
    dtypes raise: torch's kernels disagree there (mm's meta accepts them, bmm's
    does not, an empty product returns either), and a raise sends the call to
    the replicated fallback, i.e. to the real kernel.
    """
    with_bias = func in (aten.addmm.default, aten.baddbmm.default)
    bias, a, b = args[:3] if with_bias else (None, *args[:2])
    batched = func in (aten.bmm.default, aten.baddbmm.default)
    ndim = 3 if batched else 2
    if a.dim() != ndim or b.dim() != ndim:
        raise RuntimeError(f"{func}: expected {ndim}-D operands, got {a.dim()}-D and {b.dim()}-D")
    if a.shape[-1] != b.shape[-2] or (batched and a.shape[0] != b.shape[0]):
        raise RuntimeError(f"{func}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    if a.dtype != b.dtype or (bias is not None and bias.dtype != a.dtype):
        raise RuntimeError(f"{func}: operands of dtypes {a.dtype} and {b.dtype}; the dispatcher's fallback runs the "
                           "real kernel, which decides")
    out = (*a.shape[:-1], b.shape[-1])
    if bias is not None and tuple(torch._C._infer_size(bias.shape, torch.Size(out))) != out:
        raise RuntimeError(f"{func}: bias of shape {tuple(bias.shape)} does not broadcast to {out}")
    return torch.empty(out, dtype=a.dtype, device="meta")


register([aten.mm.default], Rule(mm_signatures, meta=product_meta))
register([aten.bmm.default], Rule(bmm_signatures, meta=product_meta))
register([aten.addmm.default], Rule(with_bias(mm_signatures), meta=product_meta))
register([aten.baddbmm.default], Rule(with_bias(bmm_signatures), meta=product_meta))
