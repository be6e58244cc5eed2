"""Issue 17 item 6: `gt.from_local` with Broadcast locals of different shapes on different ranks fails
naming the ranks (it gave each rank its own global shape, silently)."""
import pytest
import torch

import globaltensor as gt


def _broadcast_of_rank_dependent_shape():
    mesh = gt.placement("cpu", [0, 1, 2, 3])
    n = 3 if gt.rank() == 2 else 2
    return gt.from_local(torch.ones(n, 4), mesh, gt.broadcast)


def test_broadcast_locals_of_different_shapes_fail_naming_the_ranks():
    with pytest.raises(ValueError) as e:
        gt.launch(_broadcast_of_rank_dependent_shape, 4)
    text = str(e.value)
    assert "ranks [0, 1, 3] hold (2, 4)" in text and "ranks [2] hold (3, 4)" in text, text
    assert "gt.split" in text


def _partial_on_2x2_disagreeing_along_the_broadcast_axis():
    mesh = gt.placement("cpu", [[0, 1], [2, 3]])
    rows = 2 if gt.rank() != 3 else 1  # ranks 2 and 3 share a block of S(0) but disagree
    return gt.from_local(torch.ones(rows, 2), mesh, (gt.split(0), gt.broadcast))


def test_split_locals_that_disagree_along_a_broadcast_axis_fail():
    with pytest.raises(ValueError, match=r"ranks \[3\] disagree"):
        gt.launch(_partial_on_2x2_disagreeing_along_the_broadcast_axis, 4)


def test_agreeing_broadcast_and_partial_locals_and_explicit_shapes():
    def program():
        mesh = gt.placement("cpu", [[0, 1], [2, 3]])
        b = gt.from_local(torch.full((2, 3), 1.0), mesh, (gt.broadcast, gt.partial_sum))
        s = gt.from_local(torch.ones(2 if gt.rank() < 2 else 1, 3), mesh, (gt.split(0), gt.broadcast))
        e = gt.from_local(torch.ones(2, 3), mesh, (gt.broadcast,) * 2, shape=(2, 3))  # no exchange: checked locally
        return tuple(b.shape), b.full_tensor()[0, 0].item(), tuple(s.shape), tuple(e.shape)
    assert gt.launch(program, 4) == [((2, 3), 2.0, (3, 3), (2, 3))] * 4


def _explicit_shape_disagreeing():
    return gt.from_local(torch.ones(2 + gt.rank(), 3), gt.placement("cpu", [0, 1]), gt.broadcast, shape=(2, 3))


def test_an_explicit_shape_is_checked_on_each_rank():
    with pytest.raises(ValueError, match="rank 1 should hold a shard of shape"):
        gt.launch(_explicit_shape_disagreeing, 2)
