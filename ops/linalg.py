"""Batched linear algebra (`torch.linalg` and its older names): each matrix of a batch is computed on its own.

Every op here maps the trailing core dims of its inputs (a matrix: 2, pivots or eigenvalues: 1, an info
code or a determinant: 0) and broadcasts the leading batch dims, so a split of a batch dim passes
through: a rank factors, solves or decomposes its own matrices. torch's CPU kernels loop over the batch
calling LAPACK once per matrix, so a matrix's result does not depend on which others share its call
(the sign of an eigenvector or a singular vector included): the shards' results are the one device's.
A split of a matrix dim cannot pass (every entry of a factor reads the whole matrix) and is gathered.

Solves are also column-parallel: `A X = B` solves each column of B on its own, so with A whole a split
of B's columns gives X's columns (B's rows for the right-hand forms `X A = B`), and they are linear in
B, so a Partial B gives a Partial X. The factors a solve returns beside X (LU, pivots, info) are then
computed from the whole A on every rank: Broadcast.

`_linalg_check_errors` reads its info's values and raises: each rank checks its own shard (no
collective on the common, error-free call) and names the failing matrix by its global batch index, as
one device does (so do the kernels that raise themselves: `cholesky`, `check_errors=True`); only the
ranks holding a failing matrix raise, and `gt.launch` (or the collective watch under torchrun)
surfaces the lowest-numbered such rank's error: the first failing matrix, as on one device, when that
rank holds the earliest failure (a split of the first batch dim over ranks in mesh order), else another
failing one.

Where a split is not taken: `linalg_lstsq` keeps the fallback (torch has no meta kernel for it, and
with the gelsd/gelss drivers its residuals exist only when every matrix has full rank: a value, not a
shape, decides). `linalg_householder_product` and `ormqr` keep it too, and `_linalg_svd` splits only
without U and V (svdvals, norms), though their forward would split alike: their backward writes in
place through views of its intermediates (svd's `E.diagonal().fill_(1)`, householder's slices), and a
view whose input the dispatcher converts (a `diagonal` that falls back gathers E into a copy; `x[:, 0:1]`
of an `S(1)` x is taken from a Partial copy) does not alias its base: the writes would be lost (NaN or
wrong gradients). Run whole, every intermediate is Broadcast and the views alias.

On CUDA torch picks some solvers by batch size (batched Jacobi for eigh and svd of small matrices),
whose eigenvector signs may differ from a call on fewer matrices: only the CPU claim above is tested.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional, Sequence

import torch

from .dims import Carried, carried
from .keys import contiguous_strides
from .registry import B, P, Ctx, Rule, ShardSite, S, always, aten, register

Cores = Sequence[Optional[int]] | Callable[[Ctx], Sequence[Optional[int]]]


def batch_dims(ctx: Ctx, cin: Sequence[int], cout: Sequence[Optional[int]]) -> list[Carried]:
    """The leading batch dims carried from inputs to outputs, aligned from the right as broadcasting aligns
    them; an input (an output) whose dim is absent or of size 1 under a larger batch is whole there.

    `cout[j]` None marks an output the call leaves as an empty placeholder (svd's U without compute_uv):
    every rank makes it whole. An output whose rank says neither is not understood: nothing is carried.
    """
    outs = [(s, c) for s, c in zip(ctx.out_shapes, cout) if s is not None and c is not None]
    if not outs:
        return []
    nb = max(len(s) - c for s, c in outs)
    ref = next(s for s, c in outs if len(s) - c == nb)
    batch = ref[:nb]
    for s, c in zip(ctx.out_shapes, cout):
        if s is not None and c is None and math.prod(s) != 0:
            return []
    found = []
    for d in range(nb):
        ins = tuple(_aligned(shape[:len(shape) - c], batch, d) for shape, c in zip(ctx.shapes, cin))
        out_dims = tuple(None if s is None or c is None else _aligned(s[:len(s) - c], batch, d)
                         for s, c in zip(ctx.out_shapes, cout))
        found.append((ins, out_dims))
    return found


def _aligned(shape: Sequence[int], batch: Sequence[int], d: int) -> Optional[int]:
    """The dim of `shape` (a batch prefix) aligned with batch dim `d`, or None where it is absent or broadcast."""
    k = d - (len(batch) - len(shape))
    if k < 0 or shape[k] != batch[d]:
        return None
    return k


# -- errors naming a matrix by its global batch index ---------------------------------------------
_ELEMENT = re.compile(r"\(Batch element (\d+)\)")


def renumbered(core0: int | Callable[[Ctx], int], meta: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
    """A kernel running the op on this rank's shards whose errors name a failing matrix ("(Batch element i)",
    torch's words) by its global batch index, as one device does, not by its place in the shard.
    `core0`: the core dims of the first input, whose batch torch's index counts; `meta`: the rule's stand-in
    for a meta kernel torch lacks, used when the dispatcher checks shapes on meta shards."""
    def kernel(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
        if meta is not None and where.checking:
            return meta(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            found = _ELEMENT.search(str(e))
            if found is None or where.checking:
                raise
            core = core0(where.ctx) if callable(core0) else core0
            local, whole = args[0].shape, where.ctx.shapes[0]
            batch = len(whole) - core
            starts = [start for start, _ in where.in_box(0)[:batch]]
            index = [start + k for start, k in zip(starts, _unravel(int(found.group(1)), local[:batch]))]
            glob = _ravel(index, whole[:batch])
            raise type(e)(str(e)[:found.start()] + f"(Batch element {glob})" + str(e)[found.end():]) from None
    return kernel


def _unravel(i: int, shape: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return out[::-1]


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    i = 0
    for k, n in zip(index, shape):
        i = i * n + k
    return i


def batched(core_in: Cores, core_out: Cores,
            more: Optional[Callable[[Ctx], list]] = None, **rule: Any) -> Rule:
    """A rule splitting the batch dims (`batch_dims`), plus `more(ctx)`'s own 1-D signatures; its kernel names
    a failing matrix by its global batch index (`renumbered`)."""
    def dims(ctx: Ctx) -> list:
        cin = core_in(ctx) if callable(core_in) else core_in
        cout = core_out(ctx) if callable(core_out) else core_out
        return batch_dims(ctx, cin, cout)
    base = carried(dims)
    kernel = renumbered(lambda ctx: (core_in(ctx) if callable(core_in) else core_in)[0], rule.get("meta"))
    if more is None:
        return Rule(base.signatures, kernel=kernel, plain_when=always, **rule)

    def signatures(ctx: Ctx) -> list:
        return list(base.signatures(ctx)) + list(more(ctx))
    return Rule(signatures, kernel=kernel, plain_when=always, **rule)


def solve_signatures(b: int, x: int, cols: Callable[[Ctx], Optional[int]]) -> Callable:
    """A solve's column-parallel and linear signatures: the right-hand side (input `b`) split on the dim
    `cols(ctx)` names (None: no such dim) giving the same dim of output `x`, or Partial giving a Partial
    `x`; the other inputs (the matrix, its factors) whole, and so every other output (factors, info)."""
    def more(ctx: Ctx) -> list:
        n_in, n_out = len(ctx.shapes), len(ctx.out_shapes)
        outs = lambda sbp: tuple(sbp if j == x else B for j in range(n_out))  # noqa: E731
        ins = lambda sbp: tuple(sbp if i == b else B for i in range(n_in))  # noqa: E731
        sigs = [(ins(P), outs(P))]
        dim = cols(ctx)
        if dim is not None:
            out_dim = dim - len(ctx.shapes[b]) + len(ctx.out_shapes[x])
            sigs.append((ins(S(dim)), outs(S(out_dim))))
        return sigs
    return more


def _named(name: str, default: Any) -> Callable[[Ctx], Any]:
    return lambda ctx: ctx.named(name, default)


def columns_of(b: int, left: Callable[[Ctx], bool] = lambda ctx: True,
               vector: Callable[[Ctx], bool] = lambda ctx: False) -> Callable[[Ctx], Optional[int]]:
    """The dim of input `b` whose slices are solved independently: its columns for `A X = B` (left), its
    rows for `X A = B`; None for a vector right-hand side."""
    def cols(ctx: Ctx) -> Optional[int]:
        if vector(ctx):
            return None
        n = len(ctx.shapes[b])
        return n - 1 if left(ctx) else n - 2
    return cols


# -- factorizations and decompositions: one matrix in -------------------------------------------------
def _placeholder(flag: str, cores: tuple, at: Sequence[int], default: bool = True) -> Callable[[Ctx], tuple]:
    """Cores of the outputs, with those at positions `at` empty placeholders where argument `flag` is false."""
    def cout(ctx: Ctx) -> tuple:
        on = ctx.named(flag, default)
        return tuple(None if (not on and j in at) else c for j, c in enumerate(cores))
    return cout


def _qr_cores(ctx: Ctx) -> tuple:
    return (None, 2) if ctx.named("mode", "reduced") == "r" else (2, 2)


def _lu_unpack_cores(ctx: Ctx) -> tuple:
    data = (2, 2) if ctx.arg(2, "unpack_data", True) else (None, None)
    return (2 if ctx.arg(3, "unpack_pivots", True) else None,) + data


def geqrf_meta(func: Any, args: tuple, kwargs: dict) -> tuple:
    """geqrf has no meta kernel in torch: (the reflectors in A's shape, tau [*, min(m, n)])."""
    a = args[0]
    if a.dim() < 2:
        raise RuntimeError(f"{func}: input must have at least 2 dimensions")
    tau = (*a.shape[:-2], min(a.shape[-2], a.shape[-1]))
    # LAPACK's reflectors come back column-major, as torch's CPU kernel returns them
    *batch, m, n = a.shape
    *outer, rows, cols = contiguous_strides((*batch, n, m))
    return (torch.empty_strided(a.shape, (*outer, cols, rows), dtype=a.dtype, device="meta"),
            torch.empty(tau, dtype=a.dtype, device="meta"))


register([aten.linalg_inv_ex.default, aten.linalg_cholesky_ex.default], batched((2,), (2, 0)))
register([aten.cholesky.default, aten.cholesky_inverse.default, aten.linalg_matrix_exp.default], batched((2,), (2,)))
register([aten.linalg_lu_factor_ex.default, aten.linalg_ldl_factor_ex.default], batched((2,), (2, 1, 0)))
register([aten.linalg_lu.default], batched((2,), _placeholder("pivot", (2, 2, 2), (0,))))
register([aten.lu_unpack.default], batched((2, 1), _lu_unpack_cores))
# svd splits its batch only without U and V (an explicit compute_uv=False: torch's svdvals asks for U and V on
# a tensor subclass): its backward fills E's diagonal in place through `diagonal`, which has no rule yet and
# falls back, so a split E would be gathered into a copy and the fill lost (NaN gradients). With U and V it
# runs whole on every rank. Once `diagonal` keeps a batch split (its view then aliases), svd, eigh and eig
# can take their full batch cores, (2, 1, 2), (1, 2) and (1, 2): tests/test_ops_linalg.py checks each
# output's gradient alone, the path that breaks.
register([aten._linalg_svd.default],
         batched((2,), lambda ctx: (None, None, None) if ctx.named("compute_uv", True) else (None, 1, None)))
# eigh splits its batch only without eigenvectors (an explicit compute_v=False); eig never (eigvals asks for
# vectors on a tensor subclass): a gradient reaching the eigenvectors fills E's diagonal in place, lost as
# svd's (see above)
register([aten._linalg_eigh.default],
         batched((2,), lambda ctx: (None, None) if ctx.named("compute_v", True) else (1, None)))
register([aten.linalg_eig.default], batched((2,), (None, None)))
register([aten.linalg_qr.default], batched((2,), _qr_cores))
register([aten._linalg_det.default], batched((2,), (0, 2, 1)))
register([aten._linalg_slogdet.default], batched((2,), (0, 0, 2, 1)))
register([aten.geqrf.default], batched((2,), (2, 1), meta=geqrf_meta))
# pinv's atol and rtol, when tensors, are per matrix (0 core dims) and broadcast over the batch
register([aten.linalg_pinv.atol_rtol_tensor], batched(lambda ctx: (2,) + (0,) * (len(ctx.shapes) - 1), (2,)))


# -- solves: A X = B (or X A = B), column-parallel and linear in B --------------------------------------
def _solve_vector(ctx: Ctx) -> bool:
    """torch's rule for `linalg.solve`'s B being a vector (a batch of vectors): 1-D, or A's shape minus a dim."""
    a, b = ctx.shapes[0], ctx.shapes[1]
    return len(b) == 1 or (len(b) == len(a) - 1 and tuple(b) == tuple(a[:-1]))


def _solve_ex_cores(ctx: Ctx) -> tuple:
    c = 1 if _solve_vector(ctx) else 2
    return (2, c), (c, 2, 1, 0)


_left = _named("left", True)
register([aten._linalg_solve_ex.default],
         batched(lambda ctx: _solve_ex_cores(ctx)[0], lambda ctx: _solve_ex_cores(ctx)[1],
                 solve_signatures(1, 0, columns_of(1, _left, _solve_vector))))
register([aten.linalg_solve_triangular.default],
         batched((2, 2), (2,), solve_signatures(1, 0, columns_of(1, _left))))
register([aten.linalg_lu_solve.default],
         batched((2, 1, 2), (2,), solve_signatures(2, 0, columns_of(2, _left))))
register([aten.linalg_ldl_solve.default],
         batched((2, 1, 2), (2,), solve_signatures(2, 0, columns_of(2))))
register([aten.cholesky_solve.default], batched((2, 2), (2,), solve_signatures(0, 0, columns_of(0))))
register([aten.triangular_solve.default], batched((2, 2), (2, 2), solve_signatures(0, 0, columns_of(0))))


# -- cross products: every dim but the one crossed, and bilinear ---------------------------------------
def cross_signatures(ctx: Ctx) -> list:
    out = ctx.out_shapes[0]
    n = len(out)
    crossed = ctx.named("dim", -1) % n
    sigs = []
    for d in range(n):
        if d == crossed:
            continue
        ins = tuple(_aligned(shape, out, d) for shape in ctx.shapes)
        sigs.append((tuple(B if k is None else S(k) for k in ins), (S(d),)))
    return sigs + [((P, B), (P,)), ((B, P), (P,))]


register([aten.linalg_cross.default], Rule(cross_signatures))


# -- _linalg_check_errors: each rank checks its own matrices ------------------------------------------
def check_errors_signatures(ctx: Ctx) -> list:
    return [((S(d),), ()) for d in range(len(ctx.shapes[0]))]


register([aten._linalg_check_errors.default], Rule(check_errors_signatures, kernel=renumbered(0), plain_when=always))

__all__ = ["batch_dims", "batched", "solve_signatures", "columns_of", "cross_signatures", "renumbered",
           "geqrf_meta"]
