"""torch's operator database on global tensors (issue 34): every op equal to one device, few gathering.

Every OpInfo entry (float32, CPU, up to 3 samples; its in-place variant too) runs with each tensor
argument split (tests/op_db_sweep.py) and is compared with plain torch, forward values, the in-place
target and, for ops with autograd, input gradients. CI runs each entry on one layout, chosen by its name:
a 1-D mesh of 4, an uneven one of 3, a world larger than the mesh, or 2x2; `GT_OPDB=full` runs every
entry on every layout (run it before an op issue is resolved).

What an entry may do besides computing natively is written down here, each with its reason:
`FALLBACKS` are the aten ops that run replicated (all their inputs gathered), `ERRORS` the entries that
raise (a clear error, never a wrong value), `STRIDES` the entries whose outputs' strides differ from one
device's, where torch's own meta kernel (from which a wrapper takes its strides) disagrees with its CPU
kernel. No entry may give a wrong value or shape.
"""
from __future__ import annotations

import os
import zlib

import pytest

import op_db_sweep as sweep

FULL = os.environ.get("GT_OPDB") == "full"
OTHER = ("1d3", "world", "2x2")

# aten op -> why it runs replicated
FALLBACKS = {
    '_ctc_loss.Tensor': "lengths as tensors: no meta kernel, log_alpha's size is the longest target's (the lengths' "
                        'values say it); the int-list overload splits the batch',
    '_ctc_loss_backward.Tensor': 'lengths as tensors: no meta kernel (the values decide); the int-list overload splits'
                                 ' the batch',
    '_pdist_backward.default': "each row's gradient reads every other row (the pairs), and the feature dim's needs the"
                               ' whole distance: no split is local',
    '_pdist_forward.default': 'each output element pairs two rows, and the pairs of a row split are no contiguous '
                              'range of the output; a feature split is not exact (a p-norm of pieces)',
    '_to_sparse.default': 'a sparse result: sparse layouts are not global tensors (to_sparse returns it replicated)',
    '_to_sparse.sparse_dim': 'a sparse result: sparse layouts are not global tensors (to_sparse returns it replicated)',
    'linalg_householder_product.default': 'its backward writes in place through slices of split tensors, and a view '
                                          'whose input the dispatcher converts does not alias it (x[:, 0:1].sub_(1) on'
                                          ' S(1) leaves x unchanged): replicated (such writes now raise, naming the '
                                          'view: a split would make its backward an error)',
    'linalg_lstsq.default': 'no meta kernel in torch, and with the gelsd/gelss drivers its residuals exist only when '
                            'every matrix has full rank: the values decide the output shape',
    'median.default': "an order statistic of the whole input: no combination of the shards' medians gives it",
    'nanmedian.default': "an order statistic of the whole input: no combination of the shards' medians gives it",
    'nll_loss_backward.default': 'an unbatched sample (input [C], a 0-d target): the classes are the only dim, and '
                                 'which one is read is data',
    'nll_loss_forward.default': 'an unbatched sample (input [C], a 0-d target): the classes are the only dim, and '
                                'which one is read is data',
    'nonzero_static.default': "each output row is one nonzero's position in row-major order: which rows a rank's "
                              'nonzeros fill depends on every element before its block',
    'ormqr.default': "its backward (householder_product's) writes in place through slices of split tensors, and a view"
                     ' whose input the dispatcher converts does not alias it: replicated (such writes now raise, '
                     'naming the view: a split would make its backward an error)',
}
# op_db entry -> why it raises
ERRORS = {
    'item': "a Python value of the tensor, which a rank outside the placement (the 'world' layout) does not hold; "
            "ops/scalar.py tells it so, naming the fix",
    'equal': "a Python bool of the tensors, which a rank outside the placement (the 'world' layout) does not hold; "
             "ops/scalar.py tells it so",
    'narrow': "its start given as a 0-d tensor is read as a Python int, which a rank outside the placement (the "
              "'world' layout) does not hold; ops/scalar.py tells it so",
    'cov': "reads a Python value of its weights (a check), which a rank outside the placement (the 'world' layout) "
           "does not hold; ops/scalar.py tells it so",
    'nn.functional.gaussian_nll_loss': 'its check torch.any(var < 0) reads a Python value (.item()), which a rank '
                                       "outside the placement (the 'world' layout) does not hold; ops/scalar.py tells "
                                       'it so, naming the fix',
    'sparse.mm.reduce': 'sparse layouts are not global tensors',
    'sparse.sampled_addmm': 'sparse layouts are not global tensors',
    'tensor_split': "indices given as a tensor: torch's composite kernel reads their memory in C++ without dispatching"
                    " an op, and a GlobalTensor's wrapper holds none; give them as a list or a plain tensor",
}
# op_db entry -> why its outputs' strides are not one device's (values are still compared)
STRIDES = {
    'linalg.eig': "torch's meta kernel of linalg_eig gives row-major eigenvectors where its CPU kernel gives "
                  "column-major ones (a batch of none: (25, 5, 1), not (25, 1, 5))",
    'fft.rfftn': "torch's meta kernel of _fft_r2c gives other strides than its CPU kernel ((6, 1, 30), not (24, 4, 1) "
                 "for [5, 6, 4])",
    'svd_lowrank': "torch's meta kernel of linalg_svd gives a row-major V where its CPU kernel's is column-major",
    'pca_lowrank': "torch's meta kernel of linalg_svd gives a row-major V where its CPU kernel's is column-major",
    'to_sparse': 'a sparse result on one device, a dense replicated one here (FALLBACKS: _to_sparse)',
    'nonzero_static': "torch's meta kernel gives an empty [0, 0] result strides (1, 0), its CPU kernel (1, 1) "
                      '(it falls back: FALLBACKS says why)',
}
ENTRIES = {e.key: e for e in sweep.entries()}


def _cases() -> list:
    if FULL:
        return [(key, lay) for key in ENTRIES for lay in ("1d4",) + OTHER]
    # CI: each entry once, on a layout chosen by its name (a quarter of the entries on each): the 4 layouts x
    # 830 entries are `GT_OPDB=full`'s (about 9 CPU-minutes here, where CI's budget is the whole suite's 15)
    layouts = ("1d4",) + OTHER
    return [(key, layouts[zlib.crc32(key.encode()) % len(layouts)]) for key in ENTRIES]


@pytest.mark.parametrize("key,layout", _cases())
def test_op_db_entry(key: str, layout: str) -> None:
    out = sweep.sweep(ENTRIES[key], sweep.LAYOUTS[layout], grad=True, strides=key not in STRIDES)
    assert out.status != sweep.WRONG, f"wrong value or shape: {out}"
    if out.status == sweep.ERROR:
        assert key in ERRORS, f"raises, and ERRORS does not say why: {out}"
    unreviewed = [f for f in out.fallbacks if f.removeprefix("aten.") not in FALLBACKS]
    assert not unreviewed, f"{key} on {layout}: falls back to {unreviewed}, which FALLBACKS does not list"


def test_fallbacks_are_reviewed() -> None:
    """Every listed fallback and error has its reason."""
    assert all(len(why) > 20 for why in [*FALLBACKS.values(), *ERRORS.values(), *STRIDES.values()])
