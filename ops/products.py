"""Vector and matrix products beyond mm/bmm: dot, mv, outer products, batch-summed products, trace,
bilinear forms (`_trilinear`) and pairwise distances (`cdist`).

Each is the SBP table of a product: a dim carried from a factor to the output is split alike, a
contracted dim split in every factor that has it leaves each rank a term of the sum (P), and P passes
through any one factor with the others whole (a product is linear in each factor). Bias-added forms
(`addmv`, `addr`, `addbmm` and the in-place `addmm_`, `baddbmm_`) take their bias laid out as their
output, as `addmm` does (`ops/matrix.with_bias`). Distances are not linear: only the dims a distance
carries (rows of either operand, batch dims) split, and in the backward the feature dim too (each
feature's gradient reads its own column and the whole distance).
"""
from __future__ import annotations

from typing import Any

import torch

from .dims import batch
from .matrix import with_bias
from .registry import B, Ctx, ShardSite, P, Rule, S, aten, register


def dot_signatures(ctx: Ctx) -> list:
    """dot/vdot: the contracted (only) dim split in both -> P; P through either factor."""
    return [((S(0), S(0)), (P,)), ((P, B), (P,)), ((B, P), (P,))]


def mv_signatures(ctx: Ctx) -> list:
    """A [m,k] @ v [k]: rows carried, k contracted (P), P through either factor."""
    return [((S(0), B), (S(0),)), ((S(1), S(0)), (P,)), ((P, B), (P,)), ((B, P), (P,))]


def outer_signatures(ctx: Ctx) -> list:
    """outer(u [n], v [m]) -> [n,m]: u's dim is the output's rows, v's its columns; no contraction."""
    return [((S(0), B), (S(0),)), ((B, S(0)), (S(1),)), ((P, B), (P,)), ((B, P), (P,))]


def batch_summed_signatures(ctx: Ctx) -> list:
    """addbmm's sum_b b1[b] @ b2[b]: the batch is contracted as k is (both -> P); rows and columns carried."""
    return [((S(0), S(0)), (P,)), ((S(1), B), (S(0),)), ((B, S(2)), (S(1),)), ((S(2), S(1)), (P,)),
            ((P, B), (P,)), ((B, P), (P,))]


def bmm_signatures(ctx: Ctx) -> list:
    return [((S(0), S(0)), (S(0),)), ((S(1), B), (S(1),)), ((B, S(2)), (S(2),)),
            ((S(2), S(1)), (P,)), ((P, B), (P,)), ((B, P), (P,))]


def mm_signatures(ctx: Ctx) -> list:
    return [((S(0), B), (S(0),)), ((B, S(1)), (S(1),)), ((S(1), S(0)), (P,)), ((P, B), (P,)), ((B, P), (P,))]


register([aten.dot.default, aten.vdot.default], Rule(dot_signatures))
register([aten.mv.default], Rule(mv_signatures))
register([aten.addmv.default, aten.addmv_.default], Rule(with_bias(mv_signatures)))
register([aten.addr.default, aten.addr_.default], Rule(with_bias(outer_signatures)))
register([aten.addbmm.default], Rule(with_bias(batch_summed_signatures)))  # addbmm_: ops/inplace_view.py
register([aten.addmm_.default], Rule(with_bias(mm_signatures)))
register([aten.baddbmm_.default], Rule(with_bias(bmm_signatures)))


# -- trace: the diagonal's elements are spread over the blocks; each rank sums those it holds ------------
def trace_signatures(ctx: Ctx) -> list:
    return [((S(0),), (P,)), ((S(1),), (P,)), ((P,), (P,))]


def trace_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The global diagonal's elements in this rank's block [r0, r0+nr) x [c0, c0+nc) are the block's
    diagonal at offset r0 - c0 (global (i, i) is local (i - r0, i - c0)); every element is in one block."""
    (r0, _), (c0, _) = where.in_box(0)
    x = args[0]
    if r0 == c0:
        return func(x)
    return aten.sum.default(aten.diagonal.default(x, r0 - c0))


register([aten.trace.default], Rule(trace_signatures, kernel=trace_local))


# -- _trilinear (bilinear): a sum of products over a common index space -------------------------------
def trilinear_signatures(ctx: Ctx) -> list:
    """`_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`: each input, unsqueezed at its
    `expand` dims, spans a common index space; the output is the product summed over `sumdim`.

    A common dim that every input holding it holds at the same size (no size-1 broadcast) may be split in
    all of them: carried to the output if kept, P if summed (an input without it is constant along it,
    so whole). P passes through any one input (the product is linear in each)."""
    expands = [list(ctx.args[3]), list(ctx.args[4]), list(ctx.args[5])]
    sumdim = set(ctx.args[6])
    nd = len(ctx.shapes[0]) + len(expands[0])
    present = [[d for d in range(nd) if d not in e] for e in expands]
    kept = [d for d in range(nd) if d not in sumdim]
    sigs = []
    for d in range(nd):
        holders = [(k, present[k].index(d)) for k in range(3) if d in present[k]]
        if not holders or len({ctx.shapes[k][i] for k, i in holders}) != 1:
            continue
        ins = [B, B, B]
        for k, i in holders:
            ins[k] = S(i)
        sigs.append((tuple(ins), (P if d in sumdim else S(kept.index(d)),)))
    return sigs + [((P, B, B), (P,)), ((B, P, B), (P,)), ((B, B, P), (P,))]


register([aten._trilinear.default], Rule(trilinear_signatures))


# -- cdist ---------------------------------------------------------------------------------------------
def _same_batch(dims_of):
    """Batch dims (`ops/dims.batch`) only where no tensor broadcasts them: a broadcast batch dim would be
    summed over in the backward, which a split of it does not do."""
    def dims(ctx: Ctx) -> list:
        found = []
        for ins, outs in dims_of(ctx):
            sizes = {ctx.shapes[k][i] for k, i in enumerate(ins) if i is not None}
            sizes |= {ctx.out_shapes[k][o] for k, o in enumerate(outs) if o is not None}
            if None not in ins and len(sizes) == 1:
                found.append((ins, outs))
        return found
    return dims


_cdist_batch = _same_batch(batch([2, 2], [2]))
_cdist_grad_batch = _same_batch(batch([2, 2, 2, 2], [2]))


def cdist_signatures(ctx: Ctx) -> list:
    """x1 [.., P, M], x2 [.., R, M] -> [.., P, R]: x1's rows, x2's rows, batch dims."""
    n1, n2, no = len(ctx.shapes[0]), len(ctx.shapes[1]), len(ctx.out_shapes[0])
    sigs = [((S(a), S(b)), (S(o),)) for (a, b), (o,) in _cdist_batch(ctx)]
    return sigs + [((S(n1 - 2), B), (S(no - 2),)), ((B, S(n2 - 2)), (S(no - 1),))]


def cdist_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The Euclidean distance has two algorithms (a matmul beyond 25 rows, or differences); torch picks by
    the rows it sees, so a shard would pick by its own: the global call's choice is passed on."""
    x1, x2, p = args[0], args[1], args[2]
    mode = args[3] if len(args) > 3 else kwargs.get("compute_mode")
    if p == 2 and not mode:
        r1, r2 = where.ctx.shapes[0][-2], where.ctx.shapes[1][-2]
        mode = 1 if r1 > 25 or r2 > 25 else 2
    return func(x1, x2, p, mode)


def cdist_backward_signatures(ctx: Ctx) -> list:
    """(grad, x1, x2, p, cdist) -> grad of x1 [.., P, M]: x1's rows (grad and cdist rows alike), x2's rows
    (each rank sums its columns' terms: P), the feature dim M (each column's gradient reads its own
    differences and the whole distance), batch dims; linear in grad."""
    ng, n1, n2 = len(ctx.shapes[0]), len(ctx.shapes[1]), len(ctx.shapes[2])
    sigs = [(tuple(S(i) for i in ins), (S(o),)) for ins, (o,) in _cdist_grad_batch(ctx)]
    return sigs + [((S(ng - 2), S(n1 - 2), B, S(ng - 2)), (S(n1 - 2),)),
                   ((S(ng - 1), B, S(n2 - 2), S(ng - 1)), (P,)),
                   ((B, S(n1 - 1), S(n2 - 1), B), (S(n1 - 1),)),
                   ((P, B, B, B), (P,))]


register([aten._cdist_forward.default], Rule(cdist_signatures, kernel=cdist_local))
register([aten._cdist_backward.default], Rule(cdist_backward_signatures))
