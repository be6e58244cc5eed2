"""SBP values, placements and layouts: immutable, hashable, validated."""
import pytest
import torch

import globaltensor as gt
from globaltensor.layout import split_range, split_sizes


def test_sbp_reprs_and_identity():
    assert [repr(s) for s in (gt.split(0), gt.split(2), gt.broadcast, gt.partial_sum,
                              gt.partial("max"), gt.partial("min"))] == ["S(0)", "S(2)", "B", "P", "P(max)", "P(min)"]
    assert gt.split(1) == gt.split(1) and hash(gt.split(1)) == hash(gt.split(1))
    assert gt.partial("sum") == gt.partial_sum and gt.partial("max") != gt.partial_sum
    assert len({gt.split(0), gt.split(0), gt.broadcast, gt.Broadcast()}) == 2
    with pytest.raises(Exception):
        gt.split(0).dim = 1  # frozen


def test_placement_shape_groups_and_equality():
    p = gt.placement("cpu", [[0, 1, 2], [3, 4, 5]])
    assert p.shape == (2, 3) and p.ndim == 2 and p.device_type == "cpu"
    assert p.ranks == [[0, 1, 2], [3, 4, 5]] and p.flat_ranks == (0, 1, 2, 3, 4, 5)
    assert p.coord(4) == (1, 1) and p.coord(9) is None and p.rank_at((1, 2)) == 5
    assert p.axis_groups(0) == [(0, 3), (1, 4), (2, 5)]
    assert p.axis_groups(1) == [(0, 1, 2), (3, 4, 5)]
    assert p.group(4, 0) == (1, 4) and p.group(4, 1) == (3, 4, 5)
    assert p == gt.placement("cpu", ((0, 1, 2), (3, 4, 5))) and hash(p) == hash(gt.placement("cpu", [[0, 1, 2], [3, 4, 5]]))
    assert p != gt.placement("cpu", [0, 1, 2, 3, 4, 5])
    q = gt.placement("cpu", torch.tensor([[3, 1], [0, 2]]))
    assert q.group(1, 0) == (1, 2) and q.coord(0) == (1, 0)
    assert gt.placement("cpu", range(3)).shape == (3,)
    assert gt.placement("cpu", [[[0], [1]], [[2], [3]]]).shape == (2, 2, 1)


def test_layout_is_hashable_and_normalises_a_single_sbp():
    p = gt.placement("cpu", [0, 1])
    assert gt.Layout(p, gt.split(0)) == gt.Layout(p, (gt.split(0),))
    assert len({gt.Layout(p, gt.split(0)), gt.Layout(p, [gt.split(0)]), gt.Layout(p, gt.broadcast)}) == 2
    assert repr(gt.Layout(p, gt.split(0))) == "Layout(placement('cpu', [0, 1]), (S(0)))"


@pytest.mark.parametrize("length,parts", [(0, 3), (2, 4), (7, 3), (8, 4), (10, 4)])
def test_split_arithmetic_matches_numpy(length, parts):
    import numpy as np
    pieces = np.array_split(np.arange(length), parts)
    assert split_sizes(length, parts) == [len(x) for x in pieces]
    for i, x in enumerate(pieces):
        start, size = split_range(length, parts, i)
        assert list(range(start, start + size)) == list(x)


def test_nested_split_of_one_dim_cuts_axis0_first():
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    lay = gt.Layout(p, (gt.split(0), gt.split(0)))
    assert [lay.shard((8,), r) for r in range(4)] == [((0, 2),), ((2, 2),), ((4, 2),), ((6, 2),)]
    assert lay.shard((8,), 7) is None and lay.local_shape((8,), 7) == (0,)


def test_layouts_survive_pickling_into_another_process():
    # str hashes differ between processes: a cached hash must be rebuilt, not carried along
    import pickle
    import subprocess
    import sys
    lay = gt.Layout(gt.placement("cpu", [[0, 1], [2, 3]]), (gt.split(0), gt.partial("max")))
    code = ("import pickle, sys, globaltensor as gt; x = pickle.loads(sys.stdin.buffer.read()); "
            "y = gt.Layout(gt.placement('cpu', [[0, 1], [2, 3]]), (gt.split(0), gt.partial('max'))); "
            "print(x == y, hash(x) == hash(y), len({x, y}))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(lay), capture_output=True, check=True)
    assert out.stdout.decode().split() == ["True", "True", "1"]
