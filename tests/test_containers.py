"""A module's output keeps its container type through the runtimes that walk it (globaltensor/parallel/trees.py).

What must hold: a Hugging Face-style output (a dataclass subclass of OrderedDict registered with pytree, as
`transformers.ModelOutput` is) and a named tuple come out of a ZeRO root hint (the dispatcher's run, the ZeRO
hooks marking the outputs), a plain region (the same module's later calls, in plain torch) and pipeline
stages (one-rank stages run plain; two-rank ones through the dispatcher) as the model's own type, their
fields GlobalTensors equal to one device's, and the gradients after backward equal to one device's.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple, Optional

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import globaltensor as gt
from globaltensor.parallel import plain

B = gt.broadcast
BATCH, D_IN, D_HID, D_OUT = 8, 4, 6, 3


def _flatten(out: "ModelOutput") -> tuple:
    return list(out.values()), list(out.keys())


def _unflatten(cls: type, values: list, keys: list) -> "ModelOutput":
    return cls(**dict(zip(keys, values)))


class ModelOutput(collections.OrderedDict):
    """transformers' `ModelOutput` in small: a dataclass whose non-None fields are its items, registered with
    pytree per subclass (flattened to the non-None values, rebuilt as the same class)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        pytree.register_pytree_node(cls, _flatten, functools.partial(_unflatten, cls),
                                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                self[f.name] = v

    def __getitem__(self, k):
        return super().__getitem__(k) if isinstance(k, str) else tuple(self.values())[k]


@dataclasses.dataclass
class Output(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None  # never set: not an item, not a pytree leaf


class Pair(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


KINDS = {"model_output": lambda loss, logits: Output(loss=loss, logits=logits), "named_tuple": Pair}


class _Head(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc, self.kind = nn.Linear(D_HID, D_OUT), kind

    def forward(self, h: Pair, y: Optional[torch.Tensor] = None):  # a named tuple in: a stage's inputs walked
        logits = self.fc(h.loss * h.logits)
        # the loss per row (local under a split batch); none without a target (a pipeline's loss_fn computes it)
        return KINDS[self.kind](None if y is None else ((logits - y) ** 2).sum(-1), logits)


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, D_HID)

    def forward(self, x: torch.Tensor) -> Pair:
        h = self.fc(x)
        return Pair(torch.tanh(h), h)


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body, self.head = _Body(), _Head(kind)

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None):
        return self.head(self.body(x), y)


def _data(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64),
            torch.randn(BATCH, D_OUT, generator=g, dtype=torch.float64))


def _reference(kind: str, steps: int) -> list:
    """Per step: (loss, logits, gradients by name) of the plain model on one device."""
    torch.manual_seed(0)
    model = Net(kind).double()
    got = []
    for s in range(steps):
        out = model(*_data(s))
        assert type(out) is type(KINDS[kind](None, None))
        out.loss.sum().backward()
        got.append((out.loss.detach(), out.logits.detach(),
                    {k: p.grad.clone() for k, p in model.named_parameters()}))
        model.zero_grad()
    return got


def _seen(out) -> tuple:
    """On a rank: what the test checks of an output, (its type, its items' types, their full values)."""
    fields = (out.loss, out.logits)
    extra = (list(out.keys()), out.hidden, out["loss"] is out.loss, out[1] is out.logits) \
        if isinstance(out, Output) else ()
    return (type(out), extra, [type(f) for f in fields],
            [f.full_tensor().detach() if isinstance(f, gt.GlobalTensor) else None for f in fields])


def _check(kind: str, seen: tuple, want: tuple) -> None:
    cls, extra, types, values = seen
    assert cls is type(KINDS[kind](None, None)), cls
    if kind == "model_output":
        assert extra == (["loss", "logits"], None, True, True), extra
    assert types == [gt.GlobalTensor] * 2, types
    for got, ref in zip(values, want[:2]):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def _grads(model: nn.Module) -> dict:
    return {k: p.grad.full_tensor() for k, p in model.named_parameters() if gt.rank() in p.placement}


def _zero_run(kind: str, steps: int) -> tuple:
    p = gt.placement("cpu", [0, 1, 2, 3])
    torch.manual_seed(0)
    model = gt.to_global(Net(kind).double(), p, {"*": gt.split(0), "": gt.ModuleLayout(params=B)})
    outs, grads = [], []
    for s in range(steps):
        x, y = (gt.to_global(t, p, gt.split(0)) for t in _data(s))
        out = model(x, y)
        out.loss.sum().backward()
        outs.append(_seen(out))
        grads.append(_grads(model))
        model.zero_grad()
    whys = sorted(set(model.forward.why().values()))
    return outs, grads, whys


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("plain_on", [False, True], ids=["zero_root", "plain_region"])
def test_zero_root_and_plain_region_keep_the_output_type(kind, plain_on, monkeypatch):
    """The root gathers its parameters (ZeRO-3) and marks its outputs for the backward's re-gather; with plain
    regions on, its calls after the first run in plain torch (its ops are all local) and wrap the outputs."""
    monkeypatch.setattr(plain, "ENABLED", plain_on)
    steps = 3
    want = _reference(kind, steps)
    for outs, grads, whys in gt.launch(_zero_run, 4, args=(kind, steps)):
        assert whys == ([""] if plain_on else []), whys
        for out, got, ref in zip(outs, grads, want):
            _check(kind, out, ref)
            assert got.keys() == ref[2].keys()
            for k, g in got.items():
                torch.testing.assert_close(g, ref[2][k], rtol=0, atol=1e-12, msg=k)


def _stage_run(kind: str, per_stage: int, steps: int) -> tuple:
    first = gt.placement("cpu", list(range(per_stage)))
    last = gt.placement("cpu", list(range(per_stage, 2 * per_stage)))
    torch.manual_seed(0)
    model = gt.to_global(Net(kind).double(), first,
                         {"body.*": gt.Layout(first, (B,)), "head.*": gt.Layout(last, (B,))})
    outs, grads = [], []
    for s in range(steps):
        x, y = _data(s)
        out = model(gt.to_global(x, first, B), gt.to_global(y, last, B))
        out.loss.sum().backward()
        outs.append(_seen(out) if gt.rank() in last else type(out))
        grads.append(_grads(model))
        model.zero_grad()
    return outs, grads


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("per_stage", [1, 2])
def test_pipeline_stages_keep_the_output_type(kind, per_stage):
    """Two stages: the body's named tuple crosses the boundary into the head, whose output is the model's. One-rank
    stages run on plain tensors; two-rank ones through the dispatcher; a rank outside a stage runs it on
    empty shards, and its output is of the same type too."""
    steps = 2
    want = _reference(kind, steps)
    cls = type(KINDS[kind](None, None))
    results = gt.launch(_stage_run, 2 * per_stage, args=(kind, per_stage, steps))
    for rank, (outs, grads) in enumerate(results):
        for out, got, ref in zip(outs, grads, want):
            if rank >= per_stage:
                _check(kind, out, ref)
            else:
                assert out is cls
            held = {k for k in ref[2] if k.startswith("body" if rank < per_stage else "head")}
            assert got.keys() == held
            for k, g in got.items():
                torch.testing.assert_close(g, ref[2][k], rtol=0, atol=1e-12, msg=k)


def _mse(out, target: torch.Tensor) -> torch.Tensor:
    return ((out.logits - target) ** 2).mean()


def _pipeline_run(kind: str, steps: int) -> tuple:
    first, last = gt.placement("cpu", [0]), gt.placement("cpu", [1])
    torch.manual_seed(0)
    model = gt.to_global(Net(kind).double(), first,
                         {"body.*": gt.Layout(first, (B,)), "head.*": gt.Layout(last, (B,))})
    seen: list = []

    def loss_fn(out, target):
        seen.append(type(out))
        return _mse(out, target)
    pipe = gt.Pipeline(model, microbatches=2, schedule="1f1b", loss_fn=loss_fn)
    x, y = _data(0)
    losses, grads = [], []
    for _ in range(steps):
        loss = pipe.step(x, y)
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        grads.append(_grads(model))
        model.zero_grad()
    return losses, grads, set(seen)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_pipeline_hands_its_loss_the_models_output_type(kind):
    """gt.Pipeline over two one-rank stages: its loss function gets the model's own output type (the pipeline
    finds the loss's placement from its first tensor); the loss and gradients equal one device's. (Not replayed:
    a boundary that two tensors cross is not replayable, the named tuple here among them.)"""
    steps = 3
    torch.manual_seed(0)
    model = Net(kind).double()
    x, y = _data(0)
    loss = _mse(model(x), y)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    cls = type(KINDS[kind](None, None))
    for rank, (losses, grads, seen) in enumerate(gt.launch(_pipeline_run, 2, args=(kind, steps))):
        assert seen == {cls} if rank == 1 else seen <= {cls}, seen  # rank 0 calls it on empty shards till it learns
        if rank == 1:
            torch.testing.assert_close(losses, [loss.item()] * steps, rtol=0, atol=1e-12)
        for got in grads:
            assert got.keys() == {k for k in want if k.startswith("body" if rank == 0 else "head")}
            for k, g in got.items():
                torch.testing.assert_close(g, want[k], rtol=0, atol=1e-12, msg=k)
