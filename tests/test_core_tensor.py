"""Round-trips between full tensors, shards and GlobalTensors on the simulator."""
import itertools

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import globaltensor as gt
from strategies import expected_shard, nd_sbps, placements, tensor_shapes

REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@st.composite
def layouts_and_tensors(draw, partial=False):
    p, world = draw(placements())
    shape = draw(tensor_shapes())
    sbp = draw(nd_sbps(p.ndim, len(shape), partial))
    return p, world, shape, sbp


@given(layouts_and_tensors())
def test_to_global_shards_like_array_split_and_round_trips(case):
    p, world, shape, sbp = case
    full = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)

    def body():
        t = torch.from_numpy(full.copy())
        x = gt.to_global(t, p, sbp)
        assert x.shape == t.shape and x.dtype == t.dtype and x.sbp == tuple(sbp) and x.placement == p
        local = x.to_local()
        with gt.comm_log() as log:
            x.to_local()
        assert log.events == []  # to_global and to_local never communicate
        if gt.rank() in p:
            np.testing.assert_array_equal(local.numpy(), expected_shard(full, p, sbp, gt.rank()))
        else:
            assert local.numel() == 0
        back = x.full_tensor()
        y = gt.from_local(local, p, sbp)  # the global shape is discovered
        z = gt.from_local(local, p, sbp, shape=shape)
        assert y.shape == z.shape == t.shape
        if gt.rank() in p:
            assert torch.equal(back, t)
            assert torch.equal(y.full_tensor(), t) and torch.equal(z.to_local(), local)
        else:
            y.full_tensor()
        return True

    assert all(gt.launch(body, world))


def oracle(locals_by_coord: dict, p: gt.Placement, sbp) -> np.ndarray:
    """Global value of nd-SBP shards: reduce/concatenate the last mesh axis first."""
    level = dict(locals_by_coord)
    for axis in reversed(range(p.ndim)):
        s = sbp[axis]
        nxt = {}
        for coord in {c[:axis] for c in level}:
            parts = [level[coord + (i,)] for i in range(p.shape[axis])]
            if isinstance(s, gt.Split):
                nxt[coord] = np.concatenate(parts, axis=s.dim)
            elif isinstance(s, gt.Partial):
                out = parts[0]
                for q in parts[1:]:
                    out = REDUCE[s.op](out, q)
                nxt[coord] = out
            else:
                nxt[coord] = parts[0]
        level = nxt
    return level[()]


@given(layouts_and_tensors(partial=True), st.booleans(), st.integers(0, 2**16))
def test_from_local_partial_full_tensor_is_the_reduction(case, give_shape, seed):
    p, world, shape, sbp = case
    zeros = np.zeros(shape)

    def local_for(coord):
        # replicas along Broadcast axes must hold the same values
        key = tuple(0 if isinstance(s, gt.Broadcast) else c for s, c in zip(sbp, coord))
        rng = np.random.default_rng([seed, *key])
        r = p.rank_at(coord)
        return rng.integers(-50, 50, size=expected_shard(zeros, p, sbp, r).shape).astype(np.float64)

    coords = list(itertools.product(*map(range, p.shape)))
    want = oracle({c: local_for(c) for c in coords}, p, sbp)

    def body():
        c = p.coord(gt.rank())
        local = torch.from_numpy(local_for(c)) if c is not None else torch.empty(0, dtype=torch.float64)
        x = gt.from_local(local, p, sbp, shape=shape if give_shape else None)
        assert x.shape == want.shape
        full = x.full_tensor()
        return full.numpy() if c is not None else None

    for r, got in enumerate(gt.launch(body, world)):
        if r in p:
            np.testing.assert_array_equal(got, want)


@given(layouts_and_tensors(partial=True))
def test_to_global_with_partial_keeps_the_value(case):
    p, world, shape, sbp = case
    full = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) - 3

    def body():
        x = gt.to_global(full, p, sbp)
        return x.full_tensor() if gt.rank() in p else None

    for r, got in enumerate(gt.launch(body, world)):
        if r in p:
            assert torch.equal(got, full)


def test_uneven_and_smaller_than_mesh_shards():
    p = gt.placement("cpu", [[0, 1], [2, 3]])

    def body():
        x = gt.to_global(torch.arange(3.0), p, (gt.split(0), gt.split(0)))
        return tuple(x.to_local().tolist())

    assert gt.launch(body, 4) == [(0.0,), (1.0,), (2.0,), ()]  # [0, 1] | [2], each cut again


def test_gradients_flow_through_from_local_to_local_and_full_tensor():
    p = gt.placement("cpu", [0, 1, 2])
    w = torch.arange(7.0, dtype=torch.float64)

    def body():
        local = torch.arange(7.0, dtype=torch.float64).tensor_split(3)[gt.rank()].clone().requires_grad_()
        x = gt.from_local(local, p, gt.split(0))
        (x.full_tensor() * w).sum().backward()
        return local.grad

    grads = gt.launch(body, 3)
    assert torch.equal(torch.cat(grads), w)


def test_to_global_keeps_requires_grad_as_a_leaf():
    p = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(torch.ones(4, requires_grad=True), p, gt.split(0))
        return x.requires_grad, x.is_leaf, isinstance(x, gt.GlobalTensor)

    assert gt.launch(body, 2) == [(True, True, True)] * 2


def test_ops_run_through_the_dispatcher():
    """Ops now have rules (tests/test_ops_*.py); `x + 1` is a real GlobalTensor op."""
    p = gt.placement("cpu", [0])
    x = gt.to_global(torch.ones(2), p, gt.broadcast)
    y = x + 1
    assert isinstance(y, gt.GlobalTensor) and y.sbp == (gt.broadcast,)
    assert torch.equal(y.full_tensor(), torch.full((2,), 2.0))


def test_shards_never_alias_the_callers_tensor_or_another_rank():
    shared = torch.zeros(4)  # one object handed to every simulated rank
    p = gt.placement("cpu", [0, 1])

    def body():
        x = gt.to_global(shared, p, gt.broadcast)
        x.to_local().add_(gt.rank() + 1)  # in place on this rank's shard only
        gt.runtime.current().barrier()
        return x.to_local().tolist()

    assert gt.launch(body, 2) == [[1.0] * 4, [2.0] * 4]
    assert shared.tolist() == [0.0] * 4
