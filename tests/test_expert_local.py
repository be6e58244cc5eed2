"""Expert-local modules (`ModuleLayout(expert_local=True)`, globaltensor/parallel/experts.py's `ExpertLocal`).

A routed experts module with transformers' contract (`forward(x [T, d], index [T, k], weights [T, k])`, each
row the weighted sum of its k experts' functions, expert e reading only entry e of each parameter), written as
transformers writes its eager experts: a loop over the experts hit, each gathering its tokens and adding its
results back. Declared expert-local with its weights split by expert, it runs as expert parallelism: values and
gradients one device's, and the forward's bytes exactly the routed rows' all-to-alls (dispatch and combine)
and the count exchange, whatever the routing: skewed so that some ranks' experts get no rows, k of 1 or 2,
one or two experts per rank, a 1-D mesh or EP x DP on 2x2.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import globaltensor as gt

D = torch.float64


class LoopExperts(nn.Module):
    """transformers' eager experts, reduced: a loop over the experts hit (`num_experts` sizes it, as there)."""

    def __init__(self, experts: int, d: int = 8, h: int = 12) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, h, d, dtype=D) / d ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, d, h, dtype=D) / h ** 0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        hit = F.one_hot(index, self.num_experts).sum((0, 1)).nonzero()
        for e in hit[:, 0].tolist():
            token, j = torch.where(index == e)
            y = F.linear(F.gelu(F.linear(x[token], self.up[e])), self.down[e]) * weights[token, j, None]
            out.index_add_(0, token, y)
        return out


class Net(nn.Module):
    def __init__(self, experts: int, k: int, skew: float) -> None:
        super().__init__()
        self.k = k
        self.inp = nn.Linear(8, 8, bias=False, dtype=D)
        self.router = nn.Linear(8, experts, dtype=D)
        with torch.no_grad():
            self.router.bias.zero_()
            self.router.bias[0] = skew  # a large skew sends every token's first choice to expert 0
        self.experts = LoopExperts(experts)
        self.out = nn.Linear(8, 4, bias=False, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = torch.tanh(self.inp(x)).reshape(-1, d)
        weights, index = self.router(h).softmax(-1).topk(self.k, dim=-1)
        y = self.experts(h, index, weights / weights.sum(-1, keepdim=True))
        return self.out(y.reshape(b, s, d)).square().mean()


@settings(max_examples=12, deadline=None)
@example([0, 1, 2, 3], 1, 1, 30.0, 2, 0)   # every token's one choice expert 0's: three ranks run no rows
@example([[0, 1], [2, 3]], 2, 2, 30.0, 1, 1)
@given(st.sampled_from([[0, 1], [0, 1, 2, 3], [[0, 1], [2, 3]]]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
       st.sampled_from([0.0, 30.0]), st.integers(1, 3), st.integers(0, 2 ** 16))
def test_expert_local_equals_one_device_and_moves_the_routed_rows(mesh, per_rank, k, skew, seq, seed):
    torch.manual_seed(seed)
    ranks = sum(len(r) if isinstance(r, list) else 1 for r in mesh)
    axis, e = (1, 2) if isinstance(mesh[0], list) else (0, ranks)
    experts = per_rank * e
    net = Net(experts, k, skew)
    x = torch.randn(ranks, seq, 8, dtype=D)
    chosen: list = []
    one = copy.deepcopy(net)
    one.experts.register_forward_pre_hook(lambda m, args: chosen.append(args[1].clone()))
    want = one(x)
    want.backward()

    def body():
        p = gt.placement("cpu", mesh)
        on = tuple(gt.split(0) if a == axis else gt.broadcast for a in range(p.ndim))
        model = gt.to_global(copy.deepcopy(net), p, {"experts.*": on, "experts": gt.ModuleLayout(expert_local=True)})
        with gt.comm_log() as fwd:
            loss = model(gt.to_global(x, p, (gt.split(0),) * p.ndim))
        loss.backward()
        return loss.full_tensor(), {n: q.grad.full_tensor() for n, q in model.named_parameters()}, fwd.events
    got = gt.launch(body, ranks)
    torch.testing.assert_close(got[0][0], want.detach(), rtol=1e-12, atol=1e-14)
    for n, q in one.named_parameters():
        torch.testing.assert_close(got[0][1][n], q.grad, rtol=1e-10, atol=1e-13, msg=lambda m: f"grad {n}: {m}")
    # rank 0's forward: the count exchange ((e-1) peers' [1, E] int64), the dispatch (its expert peers' tokens'
    # choices of its experts) and the combine (its tokens' choices of other ranks' experts), d = 8 elements a row
    owner = chosen[0].reshape(ranks, seq, k)[:e] // per_rank
    rows = int((owner[1:] == 0).sum()) + int((owner[0] != 0).sum())
    moves = [ev for ev in got[0][2] if ev.kind in ("all_gather", "all_to_all")]
    assert sum(ev.recv_bytes for ev in moves) == (e - 1) * experts * 8 + rows * 8 * 8, [
        (ev.kind, ev.recv_bytes) for ev in got[0][2]]
