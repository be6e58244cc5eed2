"""`out=` calls write into their `out` GlobalTensors in the layouts those keep (before, a split `out` was
silently left as it was: the fallback wrote a Broadcast copy), on every rank of a placement and beside it."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt


def _outs(mesh, sbp):
    p = gt.placement("cpu", mesh)
    g = torch.Generator().manual_seed(0)
    x0, y0 = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    x, y = gt.to_global(x0, p, sbp), gt.to_global(y0, p, sbp)
    alt = tuple(gt.split(1) if s == gt.split(0) else gt.split(0) for s in sbp)  # an out laid out otherwise
    o1 = gt.to_global(torch.zeros(6, 4, dtype=torch.float64), p, sbp)
    o2 = gt.to_global(torch.zeros(6, 4, dtype=torch.float64), p, alt)
    vals = gt.to_global(torch.zeros(6, dtype=torch.float64), p, sbp[:1] + (gt.broadcast,) * (len(sbp) - 1))
    idx = gt.to_global(torch.zeros(6, dtype=torch.long), p, (gt.broadcast,) * len(sbp))
    got = [torch.cumsum(x, 0, out=o1) is o1, torch.add(x, y, alpha=2, out=o2) is o2]
    torch.max(x, 1, out=(vals, idx))
    want = [x0.cumsum(0), x0 + 2 * y0, x0.max(1).values, x0.max(1).indices]
    full = [o1, o2, vals, idx]
    layouts = [o.sbp for o in full]
    return got, [t.full_tensor() for t in full], want, layouts, [o1.sbp == sbp, o2.sbp == alt]


@pytest.mark.parametrize("mesh,sbp,world", [([0, 1], (gt.split(0),), 2), ([[0, 1], [2, 3]], (gt.split(0), gt.split(1)), 5)])
def test_out_variants_write_their_outs_in_their_layouts(mesh, sbp, world):
    for rank, (returned, got, want, _, kept) in enumerate(gt.launch(_outs, world, args=(mesh, sbp))):
        if rank >= 4 or rank >= len(sum(mesh, []) if isinstance(mesh[0], list) else mesh):
            continue  # a rank outside the placement: it ran the calls (empty shards), nothing to read
        assert all(returned) and all(kept)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def _bad():
    p = gt.placement("cpu", [0, 1])
    o = gt.to_global(torch.zeros(4), p, gt.split(0))
    with pytest.raises(NotImplementedError, match="out="):
        torch.arange(4, out=o)
    with pytest.raises(ValueError, match="shape"):
        torch.cumsum(gt.to_global(torch.ones(6), p, gt.split(0)), 0, out=o)
    return True


def test_out_variants_without_a_functional_form_and_wrong_shapes_are_named():
    assert gt.launch(_bad, 2) == [True, True]
