"""A catalogue of single-device models: each converts with `gt.to_global`, trains 3 AdamW steps on
1x2, 2x1 and 2x2 (data x tensor) meshes with no op falling back to replicated execution, and
matches the same program on one device (fp64); some also on a world with a rank outside the mesh.

The plans split things: the batch is `S(0)` on the data axis, and on the tensor axis weights are
Megatron-style column (`S(0)` of a Linear's [out, in] weight and its bias) and row (`S(1)`)
splits, vocab-parallel embeddings and expert-parallel (`S(0)` on the expert dim) MoE weights.
torch's test Transformer keeps its default dropout (0.1, also inside attention): random ops draw
what one device draws, whatever the layout.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.models import gpt
from thirdparty import nanogpt_model
from thirdparty.torch_test_transformer import ModelArgs, Transformer, requires_experts

D = torch.float64
STEPS = 3
MESHES = [(1, 2), (2, 1), (2, 2)]
B = gt.broadcast
COL, ROW = (B, gt.split(0)), (B, gt.split(1))  # on the tensor axis (mesh axis 1)
BATCH = (gt.split(0), B)                        # on the data axis (mesh axis 0)


def _tokens(vocab: int, shape: tuple, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# -- the models -----------------------------------------------------------------------------------
def gpt_model():
    cfg = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_embd=16)
    return gpt.GPT(cfg), (_tokens(32, (4, 8), 1), _tokens(32, (4, 8), 2)), lambda m, i, t: m(i, t)[1]


def nanogpt():
    cfg = nanogpt_model.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=4, n_embd=16, dropout=0.0, bias=True)
    data = _tokens(32, (4, 9), 3)
    return nanogpt_model.GPT(cfg), (data[:, :-1].contiguous(), data[:, 1:].contiguous()), lambda m, i, t: m(i, t)[1]


NANOGPT_PLAN = {"transformer.wte.weight": COL, "*.attn.c_proj.weight": ROW, "*.mlp.c_fc.*": COL,
                "*.mlp.c_proj.weight": ROW}  # c_attn stays Broadcast: see test_gpt_nanogpt.py


def torch_transformer(num_experts: int = 0):
    def build():
        experts = {"num_experts": num_experts} if num_experts else {}  # a field torch 2.11's ModelArgs lacks
        args = ModelArgs(n_layers=1, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, **experts)
        model = Transformer(args)

        def loss(m, tokens, targets):
            return F.cross_entropy(m(tokens).reshape(-1, args.vocab_size), targets.reshape(-1))
        return model, (_tokens(16, (4, 8), 4), _tokens(16, (4, 8), 5)), loss
    return build


TRANSFORMER_PLAN = {"tok_embeddings.weight": COL, "*.attention.wq.weight": COL, "*.attention.wk.weight": COL,
                    "*.attention.wv.weight": COL, "*.attention.wo.weight": ROW, "*.feed_forward.w1.*": COL,
                    "*.feed_forward.w2.weight": ROW}
MOE_PLAN = {"tok_embeddings.weight": COL, "*.attention.wq.weight": COL, "*.attention.wk.weight": COL,
            "*.attention.wv.weight": COL, "*.attention.wo.weight": ROW, "*.experts.w1": COL, "*.experts.w2": COL}


class RegressionMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(6, 16), nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


def regression():
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)
    return RegressionMLP(), (x, y), lambda m, x, y: F.mse_loss(m(x), y)


REGRESSION_PLAN = {"fc1.*": COL, "fc2.weight": ROW, "out.weight": (B, gt.split(1))}


class PadCast(nn.Module):
    """Pads features and time with F.pad (zeros and a constant) and casts its output with .float()."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # x: [batch, time, 4]
        h = torch.tanh(self.proj(F.pad(x, (1, 1))))               # features 4 -> 6, zero padded
        h = F.pad(h, (0, 0, 2, 0), value=0.5)                     # two steps of 0.5 before the start
        h = h[:, 2:] + 0.5 * h[:, :-2]                            # mix each step with the one two before
        return self.out(h).float()


def pad_cast():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4, 5, 4, generator=g), torch.randn(4, 5, 2, generator=g)

    def loss(m, x, y):
        return F.mse_loss(m(x), y.float())
    return PadCast(), (x, y), loss


PADCAST_PLAN = {"proj.*": COL, "out.weight": ROW}

CATALOGUE = {  # name -> (build, plan, the data's layout, meshes)
    "gpt_tp": (gpt_model, gpt.tp_plan(1, 2), BATCH, MESHES),
    "gpt_dp": (gpt_model, {}, (gt.split(0), gt.split(0)), [(2, 2)]),  # plain DP: the batch over all 4 ranks
    "nanogpt": (nanogpt, NANOGPT_PLAN, BATCH, MESHES),
    "transformer": (torch_transformer(0), TRANSFORMER_PLAN, BATCH, MESHES),
    "transformer_moe": (torch_transformer(4), MOE_PLAN, BATCH, MESHES),
    "regression_mse": (regression, REGRESSION_PLAN, BATCH, MESHES),
    "pad_cast": (pad_cast, PADCAST_PLAN, BATCH, MESHES),
}
NEEDS = {"transformer_moe": requires_experts}  # the mark of a model this torch may not have


def _cases(cases):
    """pytest params of (name, ...) cases, each with its model's mark."""
    return [pytest.param(*case, marks=NEEDS.get(case[0], ())) for case in cases]


# -- training -------------------------------------------------------------------------------------
def train(name: str, mesh=None, ranks=None):
    """Losses and final parameters; on a mesh (of `ranks`, default 0..n-1) the full values, which a rank
    outside the placement does not have: it reports what it holds instead (numel of its shards)."""
    build, plan, data_sbp, _ = CATALOGUE[name]
    torch.manual_seed(0)
    model, data, loss_of = build()
    model = model.to(D)
    data = tuple(t.to(D) if t.is_floating_point() else t for t in data)
    inside = True
    if mesh is not None:
        ranks = list(range(math.prod(mesh))) if ranks is None else ranks
        placement = gt.placement("cpu", np.array(ranks).reshape(mesh).tolist())
        inside = gt.rank() in ranks
        gt.to_global(model, placement, plan)
        data = tuple(gt.to_global(t, placement, data_sbp) for t in data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = loss_of(model, *data)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append((loss.full_tensor() if mesh else loss).item() if inside else loss._local.numel())
    params = {n: (p.full_tensor() if mesh else p).detach() if inside else p._local.numel()
              for n, p in model.named_parameters()}
    return losses, params


_REFERENCE: dict = {}


def reference(name: str):
    if name not in _REFERENCE:
        _REFERENCE[name] = train(name)
    return _REFERENCE[name]


@pytest.mark.parametrize("name,mesh", _cases([(n, m) for n in sorted(CATALOGUE) for m in CATALOGUE[n][3]]),
                         ids=lambda v: v if isinstance(v, str) else f"{v[0]}x{v[1]}")
def test_model_trains_as_on_one_device_without_fallback(name, mesh):
    want_losses, want_params = reference(name)
    gt.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(train, math.prod(mesh), args=(name, mesh))
    assert gt.stats()["fallback"] == {}
    for losses, params in results:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=1e-9)
        assert params.keys() == want_params.keys()
        for n, p in params.items():
            torch.testing.assert_close(p, want_params[n], rtol=1e-6, atol=1e-8, msg=n)


@pytest.mark.parametrize("name", _cases([("gpt_tp",), ("transformer_moe",), ("pad_cast",)]))
def test_model_trains_with_a_rank_outside_the_placement(name):
    """A 1x2 mesh on ranks [2, 0] of a 3-rank world: rank 1 holds empty shards all along, takes part in
    nothing it need not, and the ranks inside train as one device does."""
    want_losses, want_params = reference(name)
    gt.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(train, 3, args=(name, (1, 2), [2, 0]))
    assert gt.stats()["fallback"] == {}
    outside_losses, outside_params = results[1]
    assert outside_losses == [0] * STEPS and set(outside_params.values()) == {0}
    for losses, params in (results[0], results[2]):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=1e-9)
        for n, p in params.items():
            torch.testing.assert_close(p, want_params[n], rtol=1e-6, atol=1e-8, msg=n)
