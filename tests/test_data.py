"""Global batches whose order survives a restart on any world size (issue 37: the data order is saved with the
checkpoint; a 4-rank job resumed on 2 ranks reads the same next batches)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor import checkpoint as gtc
from globaltensor.data import Batches

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:load_training")


class Rows(torch.utils.data.Dataset):
    """Row i is (i, its features, its label): which rows a batch holds shows in every leaf."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"index": torch.tensor(i), "x": torch.arange(3, dtype=torch.float64) + 10 * i,
                "label": torch.tensor(i % 5)}


def _mesh(shape: tuple) -> gt.Placement:
    ranks = torch.arange(shape[0] * shape[1]).reshape(shape).tolist()
    return gt.placement("cpu", ranks)


def _read(shape: tuple, n: int, batch: int, seed: int, steps: int, state: dict | None = None) -> tuple:
    """Batch indices of `steps` batches read on a `shape` mesh (data x tensor), from `state` if given; each
    batch's leaves checked against the dataset's rows, the layout against the sbp."""
    def run():
        mesh = _mesh(shape)
        data = Batches(Rows(n), batch, mesh, (gt.split(0), gt.broadcast), seed=seed)
        if state is not None:
            data.load_state_dict(state)
        seen = []
        while len(seen) < steps:
            for b in data:
                assert b["x"].sbp == (gt.split(0), gt.broadcast) and tuple(b["x"].shape) == (batch, 3)
                idx = b["index"].full_tensor()
                assert torch.equal(b["x"].full_tensor(), torch.stack([Rows(n)[i]["x"] for i in idx.tolist()]))
                assert torch.equal(b["label"].full_tensor(), idx % 5)
                seen.append(tuple(idx.tolist()))
                if len(seen) == steps:
                    break
        return seen, data.state_dict()
    return gt.launch(run, shape[0] * shape[1])[0]


@settings(max_examples=12, deadline=None)
@given(n=st.integers(4, 23), batch=st.integers(1, 4), seed=st.integers(0, 2 ** 31), steps=st.integers(1, 9),
       cut=st.integers(0, 9), mesh=st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1), (4, 1)]))
def test_the_order_is_the_seeds_on_any_mesh_and_resumes_where_it_stopped(n, batch, seed, steps, cut, mesh):
    """The same global batches on one rank and on any data x tensor mesh (each rank reading only its rows), a
    permutation of the dataset per epoch (the last partial batch dropped), and a loader resumed from a state
    taken after `cut` batches, on another mesh, reading exactly the batches that follow."""
    batch = min(batch, n)
    whole, _ = _read((1, 1), n, batch, seed, steps + cut)
    assert _read(mesh, n, batch, seed, steps + cut)[0] == whole
    per = n // batch
    for e in range(len(whole) // per):
        epoch = [i for b in whole[e * per:(e + 1) * per] for i in b]
        assert len(set(epoch)) == len(epoch) == per * batch
    _, state = _read(mesh, n, batch, seed, cut) if cut else (None, None)
    assert _read((2, 1) if mesh != (2, 1) else (1, 2), n, batch, seed, steps, state)[0] == whole[cut:]


def test_a_checkpoint_carries_the_position_from_four_ranks_to_two(tmp_path):
    """save_training(data=) on a 2x2 mesh after 3 batches; load_training(data=) on 2 ranks continues at the
    fourth global batch, cut over two ranks; a checkpoint saved without data= refuses to resume a loader."""
    n, batch = 20, 4

    def train(mesh: tuple, path: str, save: bool, data_too: bool = True):
        p = _mesh(mesh)
        model = torch.nn.Linear(3, 1, dtype=torch.float64)
        gt.to_global(model, p, {"*": (gt.broadcast, gt.broadcast)})
        opt = torch.optim.AdamW(model.parameters())
        data = Batches(Rows(n), batch, p, (gt.split(0), gt.broadcast), seed=7)
        if save:
            it = iter(data)
            for _ in range(3):
                next(it)
            gtc.save_training(path, model, opt, 3, data=data if data_too else None)
            return None
        step = gtc.load_training(path, model, opt, data=data)
        return step, data.state_dict(), next(iter(data))["index"].full_tensor().tolist()

    gt.launch(train, 4, args=((2, 2), str(tmp_path / "a"), True))
    step, state, idx = gt.launch(train, 2, args=((2, 1), str(tmp_path / "a"), False))[0]
    assert step == 3 and (state["epoch"], state["batch"]) == (0, 3)
    ref = Batches(Rows(n), batch, _mesh((1, 1)), (gt.split(0), gt.broadcast), seed=7)
    assert idx == ref.indices(0, 3).tolist()
    gt.launch(train, 2, args=((2, 1), str(tmp_path / "b"), True, False))
    with pytest.raises(ValueError, match=r"load_training\(data\).*no data position"):
        gt.launch(train, 2, args=((2, 1), str(tmp_path / "b"), False))


def test_an_epoch_ends_and_the_next_starts_in_another_order():
    p = gt.placement("cpu", [0])

    def run():
        data = Batches(Rows(6), 2, p, gt.split(0), seed=3)
        first = [tuple(b["index"].full_tensor().tolist()) for b in data]
        assert data.state_dict()["epoch"] == 1 and data.state_dict()["batch"] == 0
        second = [tuple(b["index"].full_tensor().tolist()) for b in data]
        return first, second
    first, second = gt.launch(run, 1)[0]
    assert len(first) == len(second) == 3 and first != second
    assert sorted(i for b in first for i in b) == sorted(i for b in second for i in b) == list(range(6))


def test_workers_load_the_same_batches():
    """`num_workers` loads through torch's DataLoader: the same rows as loading in the training thread."""
    p = gt.placement("cpu", [0])

    def run(workers: int):
        data = Batches(Rows(10), 3, p, gt.split(0), seed=5, num_workers=workers)
        return [b["x"].full_tensor() for b in data]
    plain, workers = gt.launch(run, 1, args=(0,))[0], gt.launch(run, 1, args=(2,))[0]
    assert len(plain) == 3 and all(torch.equal(a, b) for a, b in zip(plain, workers))


def test_bad_arguments_are_named():
    p = gt.placement("cpu", [0, 1])
    with pytest.raises(ValueError, match=r"Batches\(batch_size\): expected a positive int"):
        Batches(Rows(4), 0, p, gt.split(0))
    with pytest.raises(ValueError, match=r"Batches\(batch_size\).*dataset has 4"):
        Batches(Rows(4), 5, p, gt.split(0))
    with pytest.raises(ValueError, match=r"Batches\(sbp\).*dim 0"):
        Batches(Rows(4), 2, p, gt.split(1))
    with pytest.raises(ValueError, match=r"Batches\(sbp\)"):
        Batches(Rows(4), 2, p, gt.partial_sum)
    data = Batches(Rows(8), 2, p, gt.split(0), seed=1)
    state = data.state_dict()
    with pytest.raises(ValueError, match=r"saved with seed=1, this loader has seed=2"):
        Batches(Rows(8), 2, p, gt.split(0), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with dataset_len=8.*dataset_len=9"):
        Batches(Rows(9), 2, p, gt.split(0), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with shuffle=1, this loader has shuffle=0"):
        Batches(Rows(8), 2, p, gt.split(0), seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['epoch'\]"):
        data.load_state_dict({k: v for k, v in state.items() if k != "epoch"})
