"""Plain regions (globaltensor/parallel/plain.py): a module whose ops are all local runs its later calls on plain tensors.

What must hold: the values, gradients and bytes are those of the dispatcher's run (so of one device); the
plain path is taken where the watch allowed it (no op reaches the dispatcher inside the module); and it is
refused, with its reason, where a plain run would compute something else: a global size read into a value,
a collective inside, a random draw, an uneven split that a view must re-cut, an empty shard on some rank.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

import globaltensor as gt
import globaltensor.tensor as gt_tensor
from globaltensor.models.gpt import GPT, GPTConfig, tp_plan, zero_plan
from globaltensor.parallel.plain import PlainRegion

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _tokens(seed: int, batch: int = 4) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, CFG.block_size), generator=torch.Generator().manual_seed(seed))


def _regions(model: nn.Module) -> dict:
    return {name: mod.__dict__["forward"] for name, mod in model.named_modules()
            if isinstance(mod.__dict__.get("forward"), PlainRegion)}


class _CountOps:
    """Counts, per thread (a simulated rank), the ops that reach the dispatcher (GlobalTensor.__torch_dispatch__)
    while that thread has it open; `install` puts the one counting entry point in place for the test."""

    def __init__(self) -> None:
        self.open: set = set()
        self.counts: dict = {}

    def install(self, monkeypatch) -> None:
        run = gt_tensor._run

        def counted(*a, **k):
            me = threading.get_ident()
            if me in self.open:
                self.counts[me] = self.counts.get(me, 0) + 1
            return run(*a, **k)
        monkeypatch.setattr(gt_tensor, "_run", counted)

    def enter(self, *_) -> None:
        self.open.add(threading.get_ident())

    def leave(self, *_) -> None:
        self.open.discard(threading.get_ident())

    def take(self) -> int:
        return self.counts.pop(threading.get_ident(), 0)


COUNT = _CountOps()


def _zero_steps(n: int, stage: int, steps: int = 3):
    p = gt.placement("cpu", list(range(n)))
    torch.manual_seed(0)
    model = gt.to_global(GPT(CFG).double(), p, zero_plan(0, 1, reshard_after_forward=stage == 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, moved, in_blocks = [], [], []
    block = model.blocks[1]  # hooks on the block itself, not inside it (counting only its forward's ops)
    block.register_forward_pre_hook(COUNT.enter)
    block.register_forward_hook(COUNT.leave, prepend=True)  # before ZeRO's own hook, whose ops are not the block's
    for s in range(steps):
        with gt.comm_log() as log:
            loss = model(gt.to_global(_tokens(s), p, gt.split(0)), gt.to_global(_tokens(s + 10), p, gt.split(0)))[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.full_tensor().detach()))
        moved.append([(e.kind, e.recv_bytes) for e in log.events])
        in_blocks.append(COUNT.take())
    whys = {name: sorted(set(r.why().values())) for name, r in _regions(model).items()}
    return losses, moved, in_blocks, whys, {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("n,stage", [(2, 3), (4, 2), (2, 2)])
def test_zero_blocks_run_plain_after_their_first_call_at_the_same_bytes(n, stage, monkeypatch):
    """The GPT's blocks under ZeRO: the first step is watched through the dispatcher, the later ones run the
    blocks in plain torch (no op of a block reaches the dispatcher); every step moves exactly the collectives
    of the first, and the losses and parameters equal one device's."""
    torch.manual_seed(0)
    ref = GPT(CFG).double()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for s in range(3):
        loss = ref(_tokens(s), _tokens(s + 10))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss))
    COUNT.install(monkeypatch)
    for losses, moved, in_blocks, whys, state in gt.launch(_zero_steps, n, args=(n, stage)):
        np.testing.assert_allclose(losses, want, rtol=0, atol=1e-12)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-12)
        assert whys == {"blocks.0": [""], "blocks.1": [""]}, whys  # both blocks plain, the root not a region
        assert in_blocks[0] > 30 and in_blocks[1:] == [0, 0], in_blocks
        assert moved[1] == moved[0] == moved[2]


def test_zero_x_tp_blocks_stay_on_the_dispatcher():
    """FSDP + TP: a block's tensor-parallel layers lay out their own outputs (their hooks need GlobalTensors),
    so the block is not a region at all."""
    p = gt.placement("cpu", [[0, 1], [2, 3]])

    def run():
        torch.manual_seed(0)
        model = gt.to_global(GPT(CFG).double(), p, zero_plan(0, 2, 1))
        batch = (gt.split(0), gt.broadcast)
        model(gt.to_global(_tokens(1), p, batch), gt.to_global(_tokens(2), p, batch))[1].backward()
        return sorted(_regions(model))
    assert gt.launch(run, 4) == [[]] * 4


class _Gathers(nn.Module):
    """Communicates inside its forward (a Broadcast of a split activation): a plain run could not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h.to_global(h.placement, gt.broadcast) * 2


def test_a_module_that_communicates_is_not_plain():
    p = gt.placement("cpu", [0, 1])

    def run():
        torch.manual_seed(0)
        model = gt.to_global(_Gathers().double(), p, {"": gt.ModuleLayout(params=gt.broadcast), "*": gt.split(0)})
        x = gt.to_global(torch.randn(4, 4, dtype=torch.float64), p, gt.split(0))
        ys = [model(x).full_tensor() for _ in range(2)]
        torch.testing.assert_close(ys[0], ys[1])
        return sorted(set(model.forward.why().values()))
    for whys in gt.launch(run, 2):
        assert whys == ["it communicates (all_gather)"], whys


class _Probe(nn.Module):
    """A block-like module whose forward the test composes: the ops a plain region must carry or refuse."""

    def __init__(self, d: int, ops: tuple) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.Linear(2 * d, d)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        h = self.ln(F.gelu(self.fc1(x)))
        for op in self.ops:
            if op == "heads":  # a view whose sizes are read off the tensor, as attention's
                h = h.view(b, t, 2, c).transpose(1, 2).contiguous().view(b, t, 2 * c)
            elif op == "softmax":
                h = h.softmax(-1)
            elif op == "global_size":  # a global size read into a value: a plain run would read the local one
                h = h / x.size(0)
            elif op == "dropout":
                h = F.dropout(h, 0.5, self.training)
        y = x + self.fc2(h)
        return y.sum(0, keepdim=True) if "sum_batch" in self.ops else y


class _Outer(nn.Module):
    def __init__(self, d: int, ops: tuple) -> None:
        super().__init__()
        self.inner = _Probe(d, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


OPS = st.lists(st.sampled_from(["heads", "softmax", "global_size", "sum_batch"]), max_size=3, unique=True).map(tuple)
LAYOUTS = {1: [(gt.split(0),), (gt.split(1),)], 2: [(gt.split(0), gt.split(1)), (gt.split(0), gt.broadcast),
                                                      (gt.split(1), gt.split(0))]}


def _probe_run(mesh: tuple, layout: tuple, ops: tuple, batch: int, seq: int, d: int, steps: int, outside: int = 0):
    """The mesh on ranks outside .. outside + n (rank 0 outside it where outside is 1)."""
    p = gt.placement("cpu", (np.arange(math.prod(mesh)) + outside).reshape(mesh).tolist())
    inside = gt.rank() in p
    torch.manual_seed(0)
    stored = (gt.split(0),) + (gt.broadcast,) * (len(mesh) - 1)
    model = gt.to_global(_Outer(d, ops).double(), p, {
        "inner": gt.ModuleLayout(params=(gt.broadcast,) * len(mesh)), "inner.*": stored})
    x0 = torch.randn(batch, seq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outs, grads, moved = [], [], []  # per call: the first watched, the later ones plain where allowed
    for s in range(steps):
        x = gt.to_global(x0 * (s + 1), p, layout).requires_grad_()
        with gt.comm_log() as log:
            y = model(x)
            (y * y).sum().backward()
        if inside:
            outs.append(y.full_tensor().detach())
            grads.append((x.grad.full_tensor(), {k: q.grad.full_tensor() for k, q in model.named_parameters()}))
        for q in model.parameters():
            q.grad = None
        moved.append([(e.kind, e.recv_bytes) for e in log.events])
    return outs, grads, moved, sorted(set(model.inner.forward.why().values()))


@given(mesh=st.sampled_from([(2,), (3,), (4,), (2, 2)]), ops=OPS, batch=st.integers(1, 6), seq=st.integers(2, 5),
       pick=st.integers(0, 2), outside=st.integers(0, 1))
@example(mesh=(2,), ops=("heads", "softmax"), batch=4, seq=3, pick=0, outside=1)
@example(mesh=(2,), ops=("global_size",), batch=4, seq=3, pick=0, outside=0)
@example(mesh=(2, 2), ops=("sum_batch", "heads"), batch=4, seq=4, pick=1, outside=0)
@example(mesh=(2,), ops=("global_size",), batch=2, seq=4, pick=1, outside=0)
def test_plain_region_values_and_bytes_equal_the_dispatcher_hypothesis(mesh, ops, batch, seq, pick, outside):
    """Over meshes, input layouts (batch or sequence split, an axis Broadcast), uneven and empty shards, a world
    larger than the mesh, and forwards that read a global size into a value or sum over the split batch (a
    Partial output): the outputs and gradients of the input and parameters equal one device's on every call,
    a plain call moves no more than the watched first one (the same where not plain); a forward that reads
    the size of a split dim into a value, an input whose split leaves some rank empty, are not plain; an even
    batch split of the others is. A rank outside the mesh moves nothing."""
    layout = LAYOUTS[len(mesh)][pick % len(LAYOUTS[len(mesh)])]
    d, steps = 4, 2
    torch.manual_seed(0)
    ref = _Outer(d, ops).double()
    x0 = torch.randn(batch, seq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = []
    for s in range(steps):
        x = (x0 * (s + 1)).requires_grad_()
        y = ref(x)
        (y * y).sum().backward()
        want.append((y.detach(), x.grad, {k: q.grad for k, q in ref.named_parameters()}))
        ref.zero_grad(set_to_none=True)
    results = gt.launch(_probe_run, math.prod(mesh) + outside, args=(mesh, layout, ops, batch, seq, d, steps, outside))
    for rank, (outs, grads, moved, whys) in enumerate(results):
        if rank < outside:
            assert outs == [] and moved == [[]] * steps
            continue
        for (y, (gx, gp)), (wy, wgx, wgp) in zip(zip(outs, grads), want):
            torch.testing.assert_close(y, wy, rtol=0, atol=1e-12)
            torch.testing.assert_close(gx, wgx, rtol=0, atol=1e-12)
            for k in wgp:
                torch.testing.assert_close(gp[k], wgp[k], rtol=0, atol=1e-12)
        # the plain call's backward is the local one behind one conversion of each output's gradient: never more
        # than the watched call's, whose backward ops choose one by one (they may move more: a Partial output's)
        assert sum(b for _, b in moved[1]) <= sum(b for _, b in moved[0]), moved
        if whys != [""]:
            assert moved[0] == moved[1]
        size = {0: batch, 1: seq}
        splits = [(n, s.dim) for n, s in zip(mesh, layout) if isinstance(s, gt.sbp.Split)]  # no dim split twice
        empty = any(size[dim] < n for n, dim in splits)
        even = all(size[dim] % n == 0 for n, dim in splits)
        batch_split, seq_split = any(dim == 0 for _, dim in splits), any(dim == 1 for _, dim in splits)
        if ("global_size" in ops and batch_split) or empty:
            assert whys != [""], whys
        elif even and not seq_split:  # (a Linear's [b, t, d] -> [b * t, d] view re-cuts a sequence split)
            assert whys == [""], whys


def test_dropout_is_not_plain():
    """Dropout draws each shard's part of one global mask (as one device would draw it): a plain run would draw
    its own, so a module with dropout on stays on the dispatcher; in eval mode it is plain."""
    p = gt.placement("cpu", [0, 1])

    def run():
        torch.manual_seed(0)
        model = gt.to_global(_Outer(4, ("dropout",)).double(), p, {"inner": gt.ModuleLayout(params=gt.broadcast),
                                                                   "inner.*": gt.split(0)})
        x = gt.to_global(torch.randn(4, 3, 4, dtype=torch.float64), p, gt.split(0))
        model(x)
        train = sorted(set(model.inner.forward.why().values()))
        model.eval()
        model(x)
        return train, sorted(set(model.inner.forward.why().values()))
    for train, both in gt.launch(run, 2):
        assert len(train) == 1 and train[0], train
        assert "" in both


def test_hooks_inside_a_region_see_global_tensors():
    """A hook on a submodule sees what it would see without plain regions: the call runs on the dispatcher."""
    p = gt.placement("cpu", [0, 1])

    def run():
        torch.manual_seed(0)
        model = gt.to_global(_Outer(4, ()).double(), p, {"inner": gt.ModuleLayout(params=gt.broadcast),
                                                         "inner.*": gt.split(0)})
        seen = []
        model.inner.fc1.register_forward_hook(lambda m, a, o: seen.append(type(o).__name__))
        x = gt.to_global(torch.randn(4, 3, 4, dtype=torch.float64), p, gt.split(0))
        for _ in range(3):
            model(x)
        return seen
    for seen in gt.launch(run, 2):
        assert seen == ["GlobalTensor"] * 3


def test_a_converted_module_with_plain_regions_deep_copies_and_pickles(tmp_path):
    """The verdicts are not carried: a copy watches its calls afresh."""
    import copy
    p = gt.placement("cpu", [0, 1])

    def run():
        torch.manual_seed(0)
        model = gt.to_global(_Outer(4, ()).double(), p, {"inner": gt.ModuleLayout(params=gt.broadcast),
                                                         "inner.*": gt.split(0)})
        x = gt.to_global(torch.randn(4, 3, 4, dtype=torch.float64), p, gt.split(0))
        y = model(x)
        twin = copy.deepcopy(model)
        assert twin.inner.forward.verdicts == {} and twin.inner.forward.module is twin.inner
        torch.testing.assert_close(twin(x).full_tensor(), y.full_tensor())
        return True
    assert all(gt.launch(run, 2))
