"""torch.save / torch.load (weights_only too) and copy.deepcopy of GlobalTensors, parameters and converted modules.

Each rank saves its own file and loads it back on the same world; on the simulator the ranks
share one process, so a rank's load must land its own shard on that rank.
"""
from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan
from strategies import nd_sbps, placements, tensor_shapes

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _rank_local(layout: gt.Layout, shape: tuple) -> torch.Tensor:
    """A shard that differs from rank to rank (so that a rank loading another's piece shows)."""
    n = int(np.prod(layout.local_shape(shape, gt.rank())))
    return (torch.arange(float(n)) + 100 * gt.rank()).reshape(layout.local_shape(shape, gt.rank()))


def _same(y: torch.Tensor, x: gt.GlobalTensor) -> None:
    assert type(y) is gt.GlobalTensor
    assert y.global_layout == x.global_layout and tuple(y.shape) == tuple(x.shape) and y.dtype == x.dtype
    assert y.requires_grad == x.requires_grad and y.layout is torch.strided
    assert torch.equal(y.to_local(), x.to_local())
    assert y.to_local().data_ptr() != x.to_local().data_ptr() or y.to_local().numel() == 0


CASES = [  # (world, mesh ranks, global shape, sbp)
    (4, [0, 1, 2, 3], (7, 3), (gt.split(0),)),                            # uneven rows
    (4, [0, 1, 2, 3], (2, 3), (gt.split(0),)),                            # fewer rows than ranks: empty shards
    (3, [0, 1, 2], (4,), (gt.broadcast,)),
    (3, [2, 0, 1], (5, 2), (gt.partial_sum,)),
    (4, [[0, 1], [2, 3]], (5, 7), (gt.split(0), gt.split(1))),
    (4, [[3, 1], [0, 2]], (5, 3), (gt.split(1), gt.split(1))),
    (4, [[0, 1], [2, 3]], (3, 4), (gt.partial("max"), gt.split(0))),
    (4, [[0, 1], [2, 3]], (3,), (gt.broadcast, gt.partial_sum)),
    (5, [[0, 1], [2, 3]], (5, 2), (gt.split(0), gt.broadcast)),           # rank 4 outside the placement
    (3, [2, 0], (5,), (gt.split(0),)),                                    # rank 1 outside
]


def _round_trip_files(world, ranks, shape, sbp, folder, weights_only):
    p = gt.placement("cpu", ranks)
    layout = gt.Layout(p, sbp)
    x = gt.from_local(_rank_local(layout, shape), p, sbp, shape=shape)
    path = folder / f"rank{gt.rank()}.pt"
    torch.save(x, path)
    y = torch.load(path, weights_only=weights_only)
    _same(y, x)
    if gt.rank() not in p:
        assert y.to_local().numel() == 0
    return y.full_tensor(), x.full_tensor()


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("world,ranks,shape,sbp", CASES)
def test_tensor_round_trips_through_per_rank_files(tmp_path, world, ranks, shape, sbp, weights_only):
    results = gt.launch(_round_trip_files, world, args=(world, ranks, shape, sbp, tmp_path, weights_only))
    p = gt.placement("cpu", ranks)
    for r, (got, want) in enumerate(results):
        assert torch.equal(got, want) if r in p else got.numel() == 0
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(f"rank{r}.pt" for r in range(world))


def _round_trip_buffer(p, shape, sbp, requires_grad):
    layout = gt.Layout(p, sbp)
    x = gt.from_local(_rank_local(layout, shape), p, sbp, shape=shape)
    if requires_grad:
        x = x.detach().requires_grad_()
    y = torch.load(_saved(x), weights_only=True)
    _same(y, x)
    assert y.is_leaf
    return torch.equal(y.full_tensor(), x.full_tensor())


@given(st.data())
def test_round_trip_property(data):
    """Any mesh (1-3 axes, ranks outside it too), shape (uneven, empty) and nd-SBP, Partial included."""
    p, world = data.draw(placements())
    shape = data.draw(tensor_shapes())
    sbp = data.draw(nd_sbps(p.ndim, len(shape), partial=True))
    requires_grad = data.draw(st.booleans())
    assert all(gt.launch(_round_trip_buffer, world, args=(p, shape, sbp, requires_grad)))


def _parameters():
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    x = gt.to_global(torch.arange(12.0).reshape(4, 3), p, (gt.split(0), gt.broadcast))
    w = torch.nn.Parameter(x)
    frozen = torch.nn.Parameter(x.detach(), requires_grad=False)
    out = []
    for weights_only in (True, False):
        got = torch.load(_saved({"w": w, "frozen": frozen, "again": w}), weights_only=weights_only)
        assert got["again"] is got["w"]  # one object saved twice stays one
        for name, want in (("w", w), ("frozen", frozen)):
            q = got[name]
            assert isinstance(q, torch.nn.Parameter) and isinstance(q, gt.GlobalTensor)
            assert q.requires_grad == want.requires_grad and q.global_layout == want.global_layout
            assert torch.equal(q.to_local(), want.to_local())
        out.append(got["w"].full_tensor())
    return out


def test_parameters_round_trip():
    for full in sum(gt.launch(_parameters, 4), []):
        assert torch.equal(full, torch.arange(12.0).reshape(4, 3))


def _refuse_another_ranks_file(folder):
    p = gt.placement("cpu", [0, 1])
    split = gt.to_global(torch.arange(4.0), p, gt.split(0))
    bcast = gt.to_global(torch.arange(4.0), p, gt.broadcast)
    torch.save({"split": split, "bcast": bcast}, folder / f"rank{gt.rank()}.pt")
    gt.runtime.current().barrier()
    other = folder / f"rank{1 - gt.rank()}.pt"
    with pytest.raises(ValueError, match=rf"saved by rank {1 - gt.rank()} is loaded on rank {gt.rank()}"):
        torch.load(other, weights_only=True)
    return True


def test_a_rank_loading_another_ranks_shard_is_refused(tmp_path):
    assert all(gt.launch(_refuse_another_ranks_file, 2, args=(tmp_path,)))


def _save_world_of_four(folder):
    x = gt.to_global(torch.arange(4.0), gt.placement("cpu", [0, 1, 2, 3]), gt.broadcast)
    torch.save(x, folder / f"rank{gt.rank()}.pt")


def _load_on_two(folder):
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] are not in the world of size 2.*world that saved it"):
        torch.load(folder / f"rank{gt.rank()}.pt", weights_only=True)
    return True


def test_loading_on_a_smaller_world_is_refused(tmp_path):
    gt.launch(_save_world_of_four, 4, args=(tmp_path,))
    assert all(gt.launch(_load_on_two, 2, args=(tmp_path,)))


def _broadcast_shard_loads_on_any_rank_of_its_axis(folder):
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    x = gt.to_global(torch.arange(6.0).reshape(2, 3), p, (gt.split(0), gt.broadcast))
    torch.save(x, folder / f"rank{gt.rank()}.pt")
    gt.runtime.current().barrier()
    twin = p.rank_at((p.coord(gt.rank())[0], 1 - p.coord(gt.rank())[1]))  # same row, other column
    y = torch.load(folder / f"rank{twin}.pt", weights_only=True)
    return torch.equal(y.full_tensor(), torch.arange(6.0).reshape(2, 3))


def test_a_broadcast_axis_shard_loads_on_any_rank_of_that_axis(tmp_path):
    assert all(gt.launch(_broadcast_shard_loads_on_any_rank_of_its_axis, 4, args=(tmp_path,)))


# -- modules ------------------------------------------------------------------------------------------
def _converted_gpt(seed, mesh=(2, 2)):
    torch.manual_seed(seed)
    model = GPT(CFG)
    p = gt.placement("cpu", np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())
    return gt.to_global(model, p, tp_plan(1, 2)), p


def _batch(p):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
    tgt = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
    return gt.to_global(idx, p, dp_batch(0, 2)), gt.to_global(tgt, p, dp_batch(0, 2))


def _step(model, p):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, tgt = _batch(p)
    _, loss = model(idx, tgt)
    loss.backward()
    opt.step()
    return loss.full_tensor().item(), {n: q.full_tensor() for n, q in model.named_parameters()}


def _state_dict_round_trip(folder):
    model, p = _converted_gpt(0)
    path = folder / f"rank{gt.rank()}.pt"
    torch.save(model.state_dict(), path)
    state = torch.load(path, weights_only=True)
    assert list(state) == list(model.state_dict())
    for name, t in model.state_dict().items():
        assert state[name].global_layout == t.global_layout and torch.equal(state[name].to_local(), t.to_local())
    fresh, _ = _converted_gpt(1)  # other values, same plan
    assert not torch.equal(fresh.blocks[0].mlp.fc.weight.to_local(), model.blocks[0].mlp.fc.weight.to_local())
    fresh.load_state_dict(state)
    assert fresh.head.weight is fresh.wte.weight
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert isinstance(b, gt.GlobalTensor) and b.global_layout == a.global_layout, name
        assert torch.equal(a.to_local(), b.to_local()), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _step(model, p), _step(fresh, p)


def test_state_dict_round_trips_and_loads_into_a_freshly_converted_module(tmp_path):
    for (loss, params), (loss2, params2) in gt.launch(_state_dict_round_trip, 4, args=(tmp_path,)):
        assert loss == loss2
        for name in params:
            assert torch.equal(params[name], params2[name]), name


def _whole_module():
    model, p = _converted_gpt(0)
    again = torch.load(_saved(model), weights_only=False)  # a pickled module: classes and layout hooks too
    assert again.head.weight is again.wte.weight
    idx, _ = _batch(p)
    with gt.comm_log() as log:
        want = model(idx).full_tensor()
    with gt.comm_log() as log_again:
        got = again(idx).full_tensor()
    assert [(e.kind, e.group) for e in log.events] == [(e.kind, e.group) for e in log_again.events]
    return torch.equal(got, want)


def test_a_whole_converted_module_pickles():
    assert all(gt.launch(_whole_module, 4))


def _deepcopy_tensor():
    p = gt.placement("cpu", [0, 1, 2])
    x = gt.to_global(torch.arange(5.0), p, gt.split(0)).requires_grad_()
    (x * x).sum().backward()
    y = copy.deepcopy(x)
    assert type(y) is gt.GlobalTensor and y.global_layout == x.global_layout and y.requires_grad and y.is_leaf
    assert torch.equal(y.to_local(), x.to_local()) and y.to_local().data_ptr() != x.to_local().data_ptr()
    assert torch.equal(y.grad.full_tensor(), 2 * torch.arange(5.0))
    with torch.no_grad():
        y.add_(1)
    return x.full_tensor(), y.full_tensor()


def test_deepcopy_of_a_global_tensor_is_independent():
    for x, y in gt.launch(_deepcopy_tensor, 3):
        assert torch.equal(x, torch.arange(5.0)) and torch.equal(y, torch.arange(5.0) + 1)


def _deepcopy_gpt():
    model, p = _converted_gpt(0)
    twin = copy.deepcopy(model)
    assert twin.head.weight is twin.wte.weight  # tied weights stay tied
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert isinstance(b, torch.nn.Parameter) and isinstance(b, gt.GlobalTensor), name
        assert b.global_layout == a.global_layout and b.requires_grad, name
        assert torch.equal(a.to_local(), b.to_local()), name
        assert b.to_local().data_ptr() != a.to_local().data_ptr(), name
    before = {n: q.full_tensor() for n, q in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gt.comm_log() as log_twin:
            twin_result = _step(twin, p)
        for n, q in model.named_parameters():  # training the copy leaves the original alone
            assert torch.equal(q.full_tensor(), before[n]), n
        with gt.comm_log() as log_model:
            model_result = _step(model, p)
    # the copy communicates as the original does (its layout hooks and deferred reductions came along)
    assert [(e.kind, e.group) for e in log_twin.events] == [(e.kind, e.group) for e in log_model.events]
    return model_result, twin_result


def test_deepcopy_of_a_converted_gpt_trains_as_the_original():
    for (loss, params), (loss2, params2) in gt.launch(_deepcopy_gpt, 4):
        assert loss == loss2
        for name in params:
            assert torch.equal(params[name], params2[name]), name


# -- real processes ------------------------------------------------------------------------------------
def _gloo_program(folder):
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    x = gt.from_local(_rank_local(gt.Layout(p, (gt.split(0), gt.partial_sum)), (5, 3)), p,
                      (gt.split(0), gt.partial_sum), shape=(5, 3))
    outside = gt.to_global(torch.arange(5.0), gt.placement("cpu", [2, 0]), gt.split(0))
    torch.manual_seed(0)
    model = gt.to_global(torch.nn.Linear(3, 4), p, {"weight": (gt.broadcast, gt.split(0))})
    path = folder / f"rank{gt.rank()}.pt"
    torch.save({"x": x, "outside": outside, "param": model.weight, "model": model.state_dict()}, path)
    got = torch.load(path, weights_only=True)
    _same(got["x"], x)
    _same(got["outside"], outside)
    assert isinstance(got["param"], torch.nn.Parameter)
    torch.manual_seed(1)
    fresh = gt.to_global(torch.nn.Linear(3, 4), p, {"weight": (gt.broadcast, gt.split(0))})
    fresh.load_state_dict(got["model"])
    return (got["x"].full_tensor().tolist(), x.full_tensor().tolist(), got["outside"].full_tensor().tolist(),
            [torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters())])


@pytest.mark.gloo
def test_save_and_load_per_rank_under_gloo_processes(tmp_path):
    results = gt.launch(_gloo_program, 4, backend="gloo", args=(tmp_path,), timeout=60)
    for r, (loaded, saved, outside, params) in enumerate(results):
        assert loaded == saved and all(params)
        assert outside == ([0.0, 1.0, 2.0, 3.0, 4.0] if r in (0, 2) else [])
    assert results == gt.launch(_gloo_program, 4, args=(tmp_path,))
