"""Frozen and unused parameters under ZeRO, as FSDP2 treats them.

Hugging Face models under ZeRO-3 meet both: a frozen parameter inside a gathering module (Whisper's
positional embedding), a parameter the forward never reads (DINOv2's `mask_token`, wav2vec2's
`masked_spec_embed`), whole frozen submodules. FSDP2 gathers them with the rest, but a frozen
parameter never gets a gradient (`.grad` stays None, the optimizer skips it) and neither does an
unused one (no error); the reduce-scatter carries only the gradients that exist. Every case here is
checked against the same program on one device (fp64, exact to 1e-10): loss, gradients (None exactly
where one device has None), parameters after AdamW steps, and the reduce-scatter's bytes.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor.parallel import zero

B = gt.broadcast
F64 = 8
STEPS = 3
D = 6


class _Block(nn.Module):
    """A block with a frozen weight among trainable ones, and a parameter its forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.pos = nn.Embedding(4, D)          # frozen (Whisper's positional embedding)
        self.norm = nn.LayerNorm(D)
        self.mask_token = nn.Parameter(torch.randn(D))  # never used (DINOv2's mask_token)
        self.pos.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.fc(x)) + self.pos.weight.sum(0))


class _Model(nn.Module):
    """(a) frozen and trainable parameters in one group (root and blocks), (b) unused parameters,
    (c) a whole frozen submodule (`frozen`, its gradient to the input still needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.frozen = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D))
        self.head = nn.Linear(D, 1)
        self.unused = nn.Linear(D, D)           # a whole submodule the forward never calls
        self.scale = nn.Parameter(torch.ones(D))
        self.scale.requires_grad_(False)        # frozen, at the root
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.scale
        for layer in self.layers:
            h = layer(h)
        return self.head(self.frozen(h))


def _x() -> torch.Tensor:
    return torch.randn(8, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _plan(blocks: bool, stage: int) -> dict:
    hint = gt.ModuleLayout(params=B, reshard_after_forward=stage == 3)
    plan = {"*": gt.split(0), "": hint}
    if blocks:
        plan.update({"layers.*": hint, "frozen": hint, "unused": hint})
    return plan


def _train(placement=None, blocks: bool = False, stage: int = 3, freeze: frozenset = frozenset()):
    """Losses, gradients after each backward (None where none) and the state after each step; with a
    placement, also the reduce-scatter bytes received per backward and the trainable parameters' layouts.
    `freeze`: names of more parameters to freeze."""
    torch.manual_seed(0)
    model = _Model().double()
    for n, q in model.named_parameters():
        if n in freeze:
            q.requires_grad_(False)
    x = _x()
    if placement is not None:
        gt.to_global(model, placement, _plan(blocks, stage))
        x = gt.to_global(x, placement, gt.split(0))
    opt = torch.optim.AdamW([q for q in model.parameters()], lr=1e-2)
    full = (lambda t: t.full_tensor()) if placement is not None else (lambda t: t.detach().clone())
    losses, grads, states, rs = [], [], [], []
    for _ in range(STEPS):
        with gt.comm_log() as log:
            loss = model(x).pow(2).mean()
            loss.backward()
        rs.append(sum(e.recv_bytes for e in log.events if e.kind == "reduce_scatter"))
        losses.append(float(full(loss.detach())))
        grads.append({n: None if q.grad is None else full(q.grad) for n, q in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        states.append({n: full(q) for n, q in model.named_parameters()})
    trainable = {n: (tuple(q.shape), q.global_layout) for n, q in model.named_parameters()
                 if q.requires_grad} if placement is not None else None
    return losses, grads, states, rs, trainable


_USED_TRAINABLE_PREFIXES = ("inp.", "layers.0.fc.", "layers.0.norm.", "layers.1.fc.", "layers.1.norm.", "head.")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("blocks", [False, True], ids=["root", "blocks"])
@pytest.mark.parametrize("stage", [3, 2])
def test_frozen_and_unused_parameters_train_as_one_device(world, blocks, stage):
    """Loss, gradients (None exactly where one device has None: frozen and unused parameters), the
    parameters after each AdamW step (frozen ones unchanged) equal one device; the reduce-scatter
    receives (d-1) x the stored shard of the used trainable parameters only."""
    want_losses, want_grads, want_states, _, _ = _train()
    first = {n: v for n, v in want_states[0].items()}
    torch.manual_seed(0)
    initial = {n: q.detach().clone() for n, q in _Model().double().named_parameters()}
    # the one-device program itself: frozen and unused parameters get no gradient and stay as they are
    for g in want_grads:
        assert {n for n, v in g.items() if v is None} == {
            "scale", "layers.0.pos.weight", "layers.1.pos.weight", "layers.0.mask_token", "layers.1.mask_token",
            "frozen.0.weight", "frozen.0.bias", "frozen.1.weight", "frozen.1.bias", "unused.weight", "unused.bias"}
    for n in ("scale", "layers.0.pos.weight", "frozen.0.weight", "unused.weight", "layers.1.mask_token"):
        torch.testing.assert_close(first[n], initial[n], rtol=0, atol=0)

    p = gt.placement("cpu", list(range(world)))
    results = gt.launch(lambda: _train(p, blocks, stage), world)
    for rank, (losses, grads, states, rs, trainable) in enumerate(results):
        for got, want in zip(losses, want_losses):
            assert got == pytest.approx(want, rel=0, abs=1e-10)
        for step, (got, want) in enumerate(zip(grads, want_grads)):
            for n, w in want.items():
                if w is None:
                    assert got[n] is None, f"step {step}: {n} got a gradient; one device has none"
                else:
                    assert got[n] is not None, f"step {step}: {n} has no gradient; one device has one"
                    torch.testing.assert_close(got[n], w, rtol=0, atol=1e-10, msg=n)
        for got, want in zip(states, want_states):
            for n, w in want.items():
                torch.testing.assert_close(got[n], w, rtol=0, atol=1e-10, msg=n)
        stored = sum(math.prod(lay.local_shape(shape, rank)) for n, (shape, lay) in trainable.items()
                     if n.startswith(_USED_TRAINABLE_PREFIXES))
        assert rs == [(world - 1) * stored * F64] * STEPS


class _FrozenAround(nn.Module):
    """A gathering module whose own parameters are all frozen around a trainable submodule that gathers its own:
    the input takes no gradient, yet the backward reads the frozen weight (the trainable one's gradient
    passes through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D)
        self.outer = nn.Linear(D, 1)
        self.outer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("kind", ["sequential", "around"])
def test_a_group_of_only_frozen_parameters_keeps_its_gather_for_the_backward(stage, kind):
    """A gathering module whose parameters are all frozen: the gradient through it reads its gathered weights
    in the backward; nothing is reduce-scattered for it, and the gradients equal one device. Where its input
    takes a gradient, ZeRO-3 frees its copies after the forward and gathers them again for the backward (as
    FSDP2 does); nothing gathered outlives the backward."""
    def run(p=None):
        torch.manual_seed(0)
        if kind == "sequential":
            model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)).double()
            model[1].requires_grad_(False)
            own = ["1"]
        else:
            model = _FrozenAround().double()
            own = ["inner"]
        x = _x()
        if p is not None:
            hint = gt.ModuleLayout(params=B, reshard_after_forward=stage == 3)
            gt.to_global(model, p, {"*": gt.split(0), "": hint, **{name: hint for name in own}})
            x = gt.to_global(x, p, gt.split(0))
        y = model(x).pow(2).sum()
        with gt.comm_log() as log:
            y.backward()
        after = zero.gathered_bytes() if p is not None else 0
        full = (lambda t: t.full_tensor()) if p is not None else (lambda t: t.detach())
        kinds = Counter(e.kind for e in log.events)
        return {n: None if q.grad is None else full(q.grad) for n, q in model.named_parameters()}, kinds, after
    want, _, _ = run()
    for got, kinds, after in gt.launch(lambda: run(gt.placement("cpu", [0, 1])), 2):
        # one reduce-scatter: the trainable group's; the frozen one's module reduces nothing
        assert kinds["reduce_scatter"] == 1
        # ZeRO-3 gathers again in the backward what it freed after the forward: both groups where the frozen
        # module's input takes a gradient (its backward is marked at both ends); only the inner one where not
        # (the frozen copies stay for autograd)
        assert kinds["all_gather"] == (0 if stage == 2 else 2 if kind == "sequential" else 1)
        assert after == 0
        for n, w in want.items():
            if w is None:
                assert got[n] is None, n
            else:
                torch.testing.assert_close(got[n], w, rtol=0, atol=1e-10, msg=n)


class _ReadsOnlyFrozen(nn.Module):
    """A gathering module whose trainable parameter the forward never reads, while its frozen weight is read on
    the input's gradient path: its gather's backward never runs (no trainable parameter takes a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.fc.requires_grad_(False)
        self.token = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("stage", [3, 2])
def test_a_module_whose_gather_takes_no_gradient_still_ends_its_backward(stage):
    """Its backward is over when the whole backward is: it leaves the named scope (a later op is not laid out
    as if inside it) and frees its copies, as FSDP2's final callback ends the groups whose hooks did not fire;
    parameters after AdamW steps equal one device."""
    from globaltensor.ops.scope import in_named

    def run(p=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, D), _ReadsOnlyFrozen(), _ReadsOnlyFrozen(), nn.Linear(D, 1)).double()
        x = _x()
        if p is not None:
            hint = gt.ModuleLayout(params=B, reshard_after_forward=stage == 3)
            gt.to_global(model, p, {"*": gt.split(0), "": hint, "1": hint, "2": hint})
            x = gt.to_global(x, p, gt.split(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        named = []
        for _ in range(STEPS):
            model(x).pow(2).sum().backward()
            named.append(in_named())
            opt.step()
            opt.zero_grad()
        full = (lambda t: t.full_tensor()) if p is not None else (lambda t: t.detach())
        return {n: full(q) for n, q in model.named_parameters()}, named, \
            zero.gathered_bytes() if p is not None else 0
    want, _, _ = run()
    for got, named, held in gt.launch(lambda: run(gt.placement("cpu", [0, 1])), 2):
        assert named == [False] * STEPS
        assert held == 0
        for n, w in want.items():
            torch.testing.assert_close(got[n], w, rtol=0, atol=1e-10, msg=n)


_NAMES = [n for n, _ in _Model().named_parameters() if n != "head.weight"]  # the loss keeps a gradient


@settings(deadline=None, max_examples=6)
@given(freeze=st.sets(st.sampled_from(_NAMES)), blocks=st.booleans(), stage=st.sampled_from([2, 3]))
def test_hypothesis_any_set_of_frozen_parameters(freeze, blocks, stage):
    """Any set of parameters frozen on top of the model's own (a whole group, all but one, none more): the
    parameters after each step equal one device, the gradients are None exactly where one device's are, and
    the reduce-scatter receives (d-1) x the stored shard of the parameters that took a gradient."""
    freeze = frozenset(freeze)
    _, want_grads, want_states, _, _ = _train(freeze=freeze)
    p = gt.placement("cpu", [0, 1])
    for rank, (_, grads, states, rs, trainable) in enumerate(gt.launch(lambda: _train(p, blocks, stage, freeze), 2)):
        for got, want in zip(grads, want_grads):
            assert {n for n, v in got.items() if v is None} == {n for n, v in want.items() if v is None}
        for got, want in zip(states, want_states):
            for n, w in want.items():
                torch.testing.assert_close(got[n], w, rtol=0, atol=1e-10, msg=n)
        stored = sum(math.prod(lay.local_shape(shape, rank)) for n, (shape, lay) in trainable.items()
                     if want_grads[0][n] is not None)
        assert rs == [stored * F64] * STEPS
