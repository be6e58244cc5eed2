"""Matrix products: the classic SBP table (DESIGN.md's `mm`), batched forms, and bias-added forms.

`matmul`/`linear` are composite in aten: autograd already lowers them to
mm/bmm/addmm plus views, so their rules are these plus the view rules.
"""
from __future__ import annotations

from typing import Any

import torch

from .registry import B, Ctx, ShardSite, P, Rule, S, aten, overloads, pointwise_dims, register


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


# -- grouped GEMM (mixture-of-experts) -----------------------------------------------------------------
def grouped_mm_signatures(ctx: Ctx) -> list:
    """`_grouped_mm(a, b, offs)`; groups are experts, `offs` the cumulative row ends of a's token groups.

    [G,m,k] @ [G,k,n]: as bmm. [M,k] @ [G,k,n] -> [M,n] (tokens grouped): experts split (each rank
    computes its experts' rows, zeros elsewhere: P), tokens split, k split (P), n split.
    [k,M] @ [M,n] -> [G,k,n] (the weight gradient): experts split (each rank sums its groups' tokens),
    tokens split (P), k split, n split. A bias is taken whole.
    """
    a, b = ctx.shapes[0], ctx.shapes[1]
    has_offs = len(ctx.shapes) > 2
    if ctx.named("bias") is not None:
        return []
    if not has_offs and len(a) == 3 and len(b) == 3:
        return bmm_signatures(ctx)
    if not has_offs:
        return []
    w = (B,)
    if len(a) == 2 and len(b) == 3:
        return [((B, S(0)) + w, (P,)), ((S(0), B) + w, (S(0),)), ((S(1), S(1)) + w, (P,)), ((B, S(2)) + w, (S(1),)),
                ((P, B) + w, (P,)), ((B, P) + w, (P,))]
    if len(a) == 2 and len(b) == 2:
        return [((B, B) + w, (S(0),)), ((S(1), S(0)) + w, (P,)), ((S(0), B) + w, (S(1),)), ((B, S(1)) + w, (S(2),)),
                ((P, B) + w, (P,)), ((B, P) + w, (P,))]
    return []


def grouped_mm_meta(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The output on meta (torch's meta kernel accepts only bf16, the CPU kernel float32 too)."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    if offs is None and a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    elif offs is not None and a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[1] and \
            offs.shape == (b.shape[0],):
        shape = (a.shape[0], b.shape[2])
    elif offs is not None and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and offs.dim() == 1:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    else:
        raise RuntimeError(f"{func}: operands {tuple(a.shape)} and {tuple(b.shape)} (offs "
                           f"{None if offs is None else tuple(offs.shape)}): left to the kernel, which decides")
    return torch.empty(shape, dtype=out_dtype or a.dtype, device="meta")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t with strides of whole 16 bytes, as the CPU grouped kernel asks (a shard of an uneven split may
    not have them): copied into a buffer whose last dim is padded, keeping t's sizes."""
    per = max(16 // t.element_size(), 1)
    *outer, rows, cols = t.stride()
    if all(s % per == 0 for s in outer) and ((cols == 1 and rows % per == 0) or (rows == 1 and cols % per == 0)):
        return t  # row- or column-major with whole 16-byte strides
    last = -(-t.shape[-1] // per) * per
    buf = t.new_zeros(tuple(t.shape[:-1]) + (last,))
    return buf[..., :t.shape[-1]].copy_(t)


def _group_rows(offs: torch.Tensor, first: int, count: int) -> tuple[int, int]:
    """The rows (tokens) of groups [first, first + count): [offs[first - 1], offs[first + count - 1])."""
    start = int(offs[first - 1]) if first > 0 else 0
    return start, (int(offs[first + count - 1]) if count else start)


def grouped_mm_local(func, args, kwargs, where: ShardSite):
    """Local experts and tokens: the rows both hold, with their groups' offsets made local."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    out_shape = where.out_shape(0)
    if a.device.type == "meta":  # the shapes the signature says (the rows below need offs' values)
        grouped_mm_meta(func, args, kwargs)  # operands that fit
        return a.new_empty(out_shape, dtype=out_dtype or a.dtype)
    if offs is None:
        return func(_aligned(a), _aligned(b), *args[2:], **kwargs)
    grads = b.dim() == 2  # [k,M] @ [M,n] -> [G,k,n]: groups on the output, tokens on a's dim 1
    g0, ng = (where.out_box(0)[0] if grads else where.in_box(1)[0])
    t0, nt = where.in_box(0)[1] if grads else where.in_box(0)[0]
    r0, r1 = _group_rows(offs, g0, ng)
    lo, hi = max(r0, t0), max(max(r0, t0), min(r1, t0 + nt))  # global token rows held here and in the groups
    local_offs = (offs[g0:g0 + ng] - lo).clamp(0, hi - lo).to(offs.dtype)
    rest = tuple(args[3:])
    if grads:
        if hi == lo or not ng:  # no tokens of these groups here
            return a.new_zeros(out_shape, dtype=out_dtype or a.dtype)
        part = func(_aligned(a.narrow(1, lo - t0, hi - lo)), _aligned(b.narrow(0, lo - t0, hi - lo)), local_offs,
                    *rest, **{k: v for k, v in kwargs.items() if k != "offs"})
        return part
    out = a.new_zeros(out_shape, dtype=out_dtype or a.dtype)
    if hi > lo and ng:
        out[lo - t0:hi - t0] = func(_aligned(a.narrow(0, lo - t0, hi - lo)), _aligned(b), local_offs, *rest,
                                    **{k: v for k, v in kwargs.items() if k != "offs"})
    return out


register(overloads("_grouped_mm"), Rule(grouped_mm_signatures, kernel=grouped_mm_local, meta=grouped_mm_meta))
