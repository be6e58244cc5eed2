"""Matrix products: the classic SBP table (DESIGN.md's `mm`), batched forms, and bias-added forms.

`matmul`/`linear` are composite in aten: autograd already lowers them to
mm/bmm/addmm plus views, so their rules are these plus the view rules.
"""
from __future__ import annotations

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


register([aten.mm.default], Rule(mm_signatures))
register([aten.bmm.default], Rule(bmm_signatures))
register([aten.addmm.default], Rule(with_bias(mm_signatures)))
register([aten.baddbmm.default], Rule(with_bias(bmm_signatures)))
