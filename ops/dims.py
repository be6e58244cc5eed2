"""Rules from dim correspondences: an op that computes each slice of some output dims from the same
slice of its inputs may split those dims.

Most ops without a Partial are of this kind along some of their dims: the batch dims of `linalg_*`
(each matrix on its own), the batch of a convolution or a pool, the dims an fft, a pad or an
upsampling leaves alone, the other dims of a scan. A rule here lists, per call, the carried dims:
for an output dim, the dim of each tensor input that is sliced alike (or None: that input is needed
whole, Broadcast). The dispatcher then checks every candidate on meta shards as for any rule; that
the values are right is each family's claim, and tests/test_op_db.py is where it is proven, op by op.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from .registry import B, Ctx, Rule, S, pointwise_dims

# one carried dim: (per tensor input, its dim sliced alike or None for whole; per output, its dim or None
# for an output the op leaves None)
Carried = tuple[tuple[Optional[int], ...], tuple[Optional[int], ...]]


def carried(dims: Callable[[Ctx], Iterable[Carried]], **rule: object) -> Rule:
    """A rule whose signatures are `dims(ctx)`'s carried dims, each split alike on one mesh axis."""
    def signatures(ctx: Ctx) -> list:
        return [(tuple(B if d is None else S(d) for d in ins), tuple(B if d is None else S(d) for d in outs))
                for ins, outs in dims(ctx)]
    return Rule(signatures, **rule)  # type: ignore[arg-type]


def batch(core_in: Sequence[int] | Callable[[Ctx], Sequence[int]],
          core_out: Sequence[int] | Callable[[Ctx], Sequence[int]]) -> Callable[[Ctx], list]:
    """The leading dims of an op that maps trailing `core` dims of each tensor (matrices: 2, vectors: 1)
    and broadcasts the rest, as `torch.linalg` does: every output batch dim is carried from the inputs'
    batch dims (aligned from the right, as broadcasting aligns them; a size-1 or absent one is whole).

    `core_in` / `core_out`: per tensor input / output, its count of core dims (or a function of the call).
    """
    def dims(ctx: Ctx) -> list:
        cin = core_in(ctx) if callable(core_in) else core_in
        cout = core_out(ctx) if callable(core_out) else core_out
        outs = [s for s in ctx.out_shapes if s is not None]
        if not outs:
            return []
        nb = len(outs[0]) - cout[0]
        batch_shape = outs[0][:nb]
        found = []
        for d in range(nb):
            ins = []
            for shape, c in zip(ctx.shapes, cin):
                sbp = pointwise_dims(shape[:len(shape) - c], batch_shape, d)
                ins.append(None if sbp == B else sbp.dim)
            out_dims = tuple(None if s is None else d + (len(s) - c) - nb for s, c in zip(ctx.out_shapes, cout))
            if any(o is not None and o < 0 for o in out_dims):
                continue
            found.append((tuple(ins), out_dims))
        return found
    return dims


def leading(n: int | Callable[[Ctx], int], whole: Sequence[int] = ()) -> Callable[[Ctx], list]:
    """The first `n` dims carried one to one from every tensor input to every output, except the inputs at
    positions `whole` (a convolution's weight and bias), needed whole."""
    def dims(ctx: Ctx) -> list:
        k = n(ctx) if callable(n) else n
        return [(tuple(None if i in whole else d for i in range(len(ctx.shapes))),
                 tuple(None if s is None else d for s in ctx.out_shapes)) for d in range(k)]
    return dims


__all__ = ["Carried", "carried", "batch", "leading"]
