"""Bad input: the error type, and a message that names the argument."""
import pytest
import torch

import globaltensor as gt


def on_ranks(fn, world=4):
    return gt.launch(fn, world)


@pytest.mark.parametrize("make,kind,arg", [
    (lambda: gt.split(-1), ValueError, "dim"),
    (lambda: gt.split(1.5), TypeError, "dim"),
    (lambda: gt.partial("mean"), ValueError, "op"),
    (lambda: gt.placement("tpu", [0, 1]), ValueError, "device_type"),
    (lambda: gt.placement("cpu", [0, 1, 1]), ValueError, "duplicate"),
    (lambda: gt.placement("cpu", [[0, 1], [2]]), ValueError, "ragged"),
    (lambda: gt.placement("cpu", [[0, 1], 2]), ValueError, "ragged"),
    (lambda: gt.placement("cpu", []), ValueError, "ranks"),
    (lambda: gt.placement("cpu", [-1, 0]), ValueError, "ranks"),
    (lambda: gt.placement("cpu", 3), TypeError, "ranks"),
    (lambda: gt.Layout(gt.placement("cpu", [[0, 1], [2, 3]]), (gt.split(0),)), ValueError, "sbp"),
    (lambda: gt.Layout(gt.placement("cpu", [[0, 1], [2, 3]]), gt.split(0)), ValueError, "sbp"),
    (lambda: gt.Layout(gt.placement("cpu", [0, 1]), ("S0",)), TypeError, "sbp"),
    (lambda: gt.Layout([0, 1], gt.broadcast), TypeError, "placement"),
    (lambda: gt.launch(lambda: 0, 0), ValueError, "world_size"),
    (lambda: gt.launch(lambda: 0, 2, backend="mpi"), ValueError, "backend"),
])
def test_bad_values(make, kind, arg):
    with pytest.raises(kind, match=arg):
        make()


def _rank_outside_world():
    gt.placement("cpu", [0, 1, 4])


def _split_dim_out_of_range():
    gt.to_global(torch.ones(2, 3), gt.placement("cpu", [0, 1]), gt.split(2))


def _sbp_length():
    gt.to_global(torch.ones(2, 3), gt.placement("cpu", [[0, 1], [2, 3]]), (gt.split(0),))


def _mismatched_global_shape():
    p = gt.placement("cpu", [0, 1])
    gt.from_local(torch.ones(3, 2), p, gt.split(0), shape=(4, 2))


def _inconsistent_shards():
    p = gt.placement("cpu", [0, 1, 2, 3])
    # sizes 1, 1, 3, 1 are no array_split of any length
    gt.from_local(torch.ones(3 if gt.rank() == 2 else 1, 2), p, gt.split(0))


def _shard_ndims_differ():
    p = gt.placement("cpu", [0, 1, 2, 3])
    gt.from_local(torch.ones((2, 2) if gt.rank() else (2,)), p, gt.broadcast, )


def _not_a_tensor():
    gt.to_global([1, 2], gt.placement("cpu", [0, 1]), gt.broadcast)


def _from_local_of_global():
    p = gt.placement("cpu", [0, 1])
    gt.from_local(gt.to_global(torch.ones(2), p, gt.broadcast), p, gt.broadcast)


def _bad_shape_arg():
    gt.from_local(torch.ones(2), gt.placement("cpu", [0, 1]), gt.broadcast, shape=(2.0,))


@pytest.mark.parametrize("fn,kind,arg", [
    (_rank_outside_world, ValueError, "not in the world"),
    (_split_dim_out_of_range, ValueError, "sbp"),
    (_sbp_length, ValueError, "sbp"),
    (_mismatched_global_shape, ValueError, "shape"),
    (_inconsistent_shards, ValueError, "local"),
    (_not_a_tensor, TypeError, "tensor"),
    (_from_local_of_global, TypeError, "local"),
    (_bad_shape_arg, TypeError, "shape"),
])
def test_bad_input_inside_ranks(fn, kind, arg):
    with pytest.raises(kind, match=arg) as info:
        on_ranks(fn)
    assert info.value.rank == 0  # every rank sees the error; the lowest rank is reported


def test_broadcast_shards_of_different_ndim_is_an_error():
    # shapes are exchanged for B too (issue 17 item 6): ranks that disagree fail instead of each
    # rank going on with its own global shape
    with pytest.raises(ValueError, match="different numbers of dims"):
        on_ranks(_shard_ndims_differ)
