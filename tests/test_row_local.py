"""Row-local modules (`ModuleLayout(row_local=True)`, globaltensor/parallel/plain.py's `RowLocal`).

A module whose every output row is computed from its own input row alone may be written as a program over the
whole batch (Hugging Face's MoE blocks sort every token by expert): on a batch split the dispatcher runs that
program exactly, moving tokens between ranks. Declared row-local it runs on each rank's rows, as DDP runs it:
values and gradients still one device's, and the bytes DDP's (the gradients' all-reduce only). What the
declaration cannot make right is refused by name: parameters split while it runs, rows that do not divide
alike, an output with no rows.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import globaltensor as gt

D = torch.float64


class SortedMoE(nn.Module):
    """A dropless top-1 mixture of experts written as transformers writes it: every token of the batch sorted
    by its expert, each expert run on its run of tokens, the results put back in token order. Row-local (a
    token's output is its own), but the program sorts across the whole batch. Returns the output and the
    router's logits per token ([batch * seq, experts]), as a MoE block's router logits are."""

    def __init__(self, d: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, d, d) / d ** 0.5)

    def forward(self, x: torch.Tensor) -> tuple:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        logits = self.router(tokens)
        weight, choice = logits.softmax(-1).max(-1)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=self.experts.shape[0]).tolist()
        out, at = [], 0
        for e, n in enumerate(counts):
            rows = order[at:at + n]
            out.append(tokens[rows] @ self.experts[e] * weight[rows, None])
            at += n
        y = torch.zeros_like(tokens).index_copy(0, order, torch.cat(out))
        return y.reshape(b, s, d), logits


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)  # (a bias gradient may take another route: not this test's business)
        self.moe = SortedMoE()
        self.out = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple:
        h, logits = self.moe(torch.tanh(self.inp(x)))
        return self.out(h).square().mean() + 0.01 * logits.square().mean()


def _step(plan: dict, mesh: list, batch_sbp, x: torch.Tensor, net: nn.Module) -> list:
    def body():
        p = gt.placement("cpu", mesh)
        model = gt.to_global(copy.deepcopy(net), p, plan)
        with gt.comm_log() as fwd:
            loss = model(gt.to_global(x, p, batch_sbp))
        with gt.comm_log() as bwd:
            loss.backward()
        with gt.comm_log() as reduce:  # the Partial gradients' all-reduce (as the optimizer's first read runs it)
            grads = {n: q.grad.full_tensor() for n, q in model.named_parameters()}
        return (loss.full_tensor(), grads, fwd.recv_bytes, bwd.recv_bytes + reduce.recv_bytes,
                len(fwd.events) + len(bwd.events))
    return gt.launch(body, sum(len(r) if isinstance(r, list) else 1 for r in mesh))


def _one_device(net: nn.Module, x: torch.Tensor) -> tuple:
    m = copy.deepcopy(net)
    loss = m(x)
    loss.backward()
    return loss.detach(), {n: q.grad for n, q in m.named_parameters()}


@given(st.sampled_from([[0, 1], [0, 1, 2, 3], [[0, 1], [2, 3]]]), st.sampled_from([1, 2]), st.integers(0, 3))
def test_a_row_local_moe_equals_one_device_and_moves_only_the_gradients(mesh, per_rank, seed):
    """On a batch split (1-D, or the data axis of a 2-D mesh with the other axis whole), declared row-local the
    sorted MoE gives one device's loss and gradients; its forward moves nothing, its backward nothing but the
    gradients' reduction (DDP's all-reduce: 2Ψ(n-1)/n over the data ranks)."""
    torch.manual_seed(seed)
    net = Net().to(D)
    data = len(mesh)
    x = torch.randn(data * per_rank, 5, 8, dtype=D)
    want_loss, want_grads = _one_device(net, x)
    sbp = (gt.split(0), gt.broadcast) if isinstance(mesh[0], list) else gt.split(0)
    params = sum(q.numel() for q in net.parameters()) * 8
    for loss, grads, fwd, bwd, _ in _step({"moe": gt.ModuleLayout(row_local=True)}, mesh, sbp, x, net):
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
        for n, g in want_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12)
        assert fwd == 0  # the loss stays Partial
        assert bwd == 2 * params * (data - 1) // data


def test_without_the_declaration_the_program_moves_tokens_and_still_equals_one_device():
    """The same program undeclared: exact (the dispatcher runs the global sort), at the price of moving
    tokens between ranks, which the declaration saves."""
    torch.manual_seed(0)
    net = Net().to(D)
    x = torch.randn(4, 5, 8, dtype=D)
    want_loss, want_grads = _one_device(net, x)
    undeclared = _step({}, [0, 1], gt.split(0), x, net)
    declared = _step({"moe": gt.ModuleLayout(row_local=True)}, [0, 1], gt.split(0), x, net)
    for loss, grads, *_ in undeclared:
        torch.testing.assert_close(loss, want_loss)
        for n, g in want_grads.items():
            torch.testing.assert_close(grads[n], g)
    assert sum(r[2] + r[3] for r in undeclared) > sum(r[2] + r[3] for r in declared)
    assert sum(r[4] for r in undeclared) > sum(r[4] for r in declared)


def test_inside_a_zero3_block_it_runs_on_the_gathered_parameters():
    """ZeRO-3 gathers the block's parameters (Broadcast while it runs): the row-local module inside runs on them,
    its parameters' gradients Partial over the data ranks, reduce-scattered as any."""
    torch.manual_seed(1)
    net = Net().to(D)
    x = torch.randn(4, 5, 8, dtype=D)
    want_loss, want_grads = _one_device(net, x)
    plan = {"*": gt.split(0), "": gt.ModuleLayout(params=gt.broadcast), "moe": gt.ModuleLayout(row_local=True)}
    for loss, grads, *_ in _step(plan, [0, 1, 2, 3], gt.split(0), x, net):
        torch.testing.assert_close(loss, want_loss)
        for n, g in want_grads.items():
            torch.testing.assert_close(grads[n], g)


def _raises(plan: dict, mesh: list, batch: int, match: str, exc=RuntimeError) -> None:
    net = Net().to(D)
    with pytest.raises(exc, match=match):
        _step(plan, mesh, gt.split(0), torch.randn(batch, 5, 8, dtype=D), net)


def test_what_the_declaration_cannot_make_right_is_refused_by_name():
    rows = gt.ModuleLayout(row_local=True)
    # split parameters while it runs: a rank's rows would meet a shard of a weight
    _raises({"moe.experts": gt.split(0), "moe": rows}, [0, 1], 4, r"'experts'.*params=gt.broadcast", ValueError)
    # rows that do not divide alike over the ranks: the outputs' rows would not be a balanced split
    _raises({"moe": rows}, [0, 1, 2], 4, "divide")
    with pytest.raises(TypeError, match="row_local"):
        gt.ModuleLayout(row_local=1)


class Inner(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Outer(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.inner = Inner(fn)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("fn, batch, match", [
    (lambda x: x.sum(), 4, "not row-local"),   # a scalar has no rows to give each rank
    (lambda x: x * 2, 2, "holds none"),        # 2 rows over 4 ranks: ranks 2 and 3 would run on nothing
])
def test_outputs_without_rows_and_ranks_without_rows_are_refused(fn, batch, match):
    def body():
        p = gt.placement("cpu", [0, 1, 2, 3])
        m = gt.to_global(Outer(fn), p, {"inner": gt.ModuleLayout(row_local=True)})
        return m(gt.to_global(torch.ones(batch, 3, dtype=D), p, gt.split(0)))
    with pytest.raises(RuntimeError, match=match):
        gt.launch(body, 4)


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.integers(0, 3))
def test_with_parameters_split_on_another_axis_each_data_rank_runs_its_rows_over_its_tensor_group(dim, per_rank,
                                                                                                   seed):
    """On a data x tensor mesh with the experts split on the tensor axis (dim 1: their input features; 2: their
    output features), the row-local module runs on each data rank's rows as a global program over that rank's
    tensor group (Megatron's DP x TP: each data rank's tokens through the tensor-parallel experts): one device's
    loss and gradients, and no forward collective outside a tensor group, so no token crosses a data rank (the
    undeclared program's forward sorts the whole batch over every rank)."""
    torch.manual_seed(seed)
    net = Net().to(D)
    x = torch.randn(2 * per_rank, 5, 8, dtype=D)
    want_loss, want_grads = _one_device(net, x)
    mesh, tensor_groups = [[0, 1], [2, 3]], [{0, 1}, {2, 3}]

    def body(plan: dict):
        p = gt.placement("cpu", mesh)
        model = gt.to_global(copy.deepcopy(net), p, plan)
        with gt.comm_log() as fwd:
            loss = model(gt.to_global(x, p, (gt.split(0), gt.broadcast)))
        loss.backward()
        return (loss.full_tensor(), {n: q.grad.full_tensor() for n, q in model.named_parameters()},
                [set(e.group) for e in fwd.events if e.recv_bytes])
    split = {"moe.experts": (gt.broadcast, gt.split(dim))}
    for loss, grads, groups in gt.launch(body, 4, args=({**split, "moe": gt.ModuleLayout(row_local=True)},)):
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
        for n, g in want_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12)
        assert all(any(g <= t for t in tensor_groups) for g in groups), groups
    undeclared = gt.launch(body, 4, args=(split,))
    assert any(not any(g <= t for t in tensor_groups) for r in undeclared for g in r[2])
