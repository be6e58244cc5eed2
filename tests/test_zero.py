"""ZeRO-2/3 from placement: parameters stored split on the data axis, used Broadcast per module.

Every case trains against the same program on one device (fp64, to 1e-10) and counts what moves
with `gt.comm_log()` against the ZeRO paper's bytes: per step and rank, ZeRO-3 receives
3 Psi (n-1)/n elements (all-gather forward, all-gather backward, reduce-scatter backward), ZeRO-2
2 Psi (n-1)/n; the optimizer step moves nothing. Exactly, per collective kind and phase.

The GPT here has more tokens per rank than vocabulary entries. With fewer (a small batch on many
ranks), the dispatcher computes the embedding's weight gradient from token gradients moved by an
all-to-all, split on the hidden dim, instead of reduce-scattering a vocabulary-sized Partial: fewer
bytes than the textbook's count, chosen by cost; the paper's count is then an upper bound.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor import zero
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan, zero_plan
from globaltensor.runtime.comm import all_reduce_recv_bytes

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16)
BATCH = 8
F64 = 8
B = gt.broadcast


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=torch.Generator().manual_seed(seed))


assert BATCH * CFG.block_size // 4 >= CFG.vocab_size  # tokens per rank on 4 ranks: see the module docstring


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    if kind == "adamw-loop":
        return torch.optim.AdamW(params, lr=1e-2, foreach=False)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(model, idx, tgt, steps: int, opt_kind: str, clip: str | None, log_steps: bool = False):
    """Losses per step (and per-step comm logs by phase when asked); same code on one device and global."""
    opt = _optimizer(opt_kind, model.parameters())
    losses, logs = [], []
    for _ in range(steps):
        with gt.comm_log() as fwd:
            loss = model(idx, tgt)[1]
        with gt.comm_log() as bwd:
            loss.backward()
        with gt.comm_log() as step:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=clip == "foreach")
            opt.step()
            opt.zero_grad()
        losses.append(loss)
        if log_steps:
            logs.append({"forward": fwd.events, "backward": bwd.events, "step": step.events})
    return losses, logs


def _reference(steps: int, opt_kind: str, clip: str | None):
    torch.manual_seed(0)
    model = GPT(CFG).double()
    losses, _ = _train(model, _tokens(1), _tokens(2), steps, opt_kind, clip)
    return [float(x.detach()) for x in losses], {k: v.detach() for k, v in model.state_dict().items()}


def _mesh(shape: tuple) -> gt.Placement:
    return gt.placement("cpu", np.arange(math.prod(shape)).reshape(shape).tolist())


def _global_run(shape: tuple, stage: int, steps: int, opt_kind: str, clip: str | None):
    p = _mesh(shape)
    tensor_axis = 1 if len(shape) == 2 else None
    torch.manual_seed(0)
    model = gt.to_global(GPT(CFG).double(), p, zero_plan(0, len(shape), tensor_axis,
                                                        reshard_after_forward=stage == 3))
    batch = dp_batch(0, len(shape))
    idx, tgt = (gt.to_global(t, p, batch) for t in (_tokens(1), _tokens(2)))
    losses, logs = _train(model, idx, tgt, steps, opt_kind, clip, log_steps=True)
    axis_of = {tuple(g): a for a in range(p.ndim) for g in p.axis_groups(a)}
    counted = []
    for log in logs:
        c = Counter()
        for phase, events in log.items():
            for e in events:
                c[(phase, e.kind, axis_of.get(e.group, e.group))] += e.recv_bytes
        counted.append(c)
    layouts = [(tuple(q.shape), q.global_layout) for q in model.parameters()]
    return ([float(x.full_tensor().detach()) for x in losses], {k: v.full_tensor() for k, v in model.state_dict().items()},
            counted, layouts, dict(gt.stats()["fallback"]))


def zero_bytes(layouts: list, stage: int, rank: int, data_axis: int = 0) -> Counter:
    """What ZeRO moves on the data axis, per phase and kind, for this rank: from the parameters' layouts.

    A parameter split on the data axis is all-gathered (its compute shard less the stored one) forward
    and, for ZeRO-3, again backward, and its gradient reduce-scattered ((d-1) x the stored shard); a
    parameter Broadcast on the data axis has its gradient all-reduced. The loss's mean over the split
    batch all-reduces one scalar (the count of targets) forward.
    """
    out = Counter()
    for shape, lay in layouts:
        p = lay.placement
        d = p.shape[data_axis]
        if d == 1:
            continue
        stored = lay.local_shape(shape, rank)
        compute = gt.Layout(p, tuple(B if a == data_axis else s for a, s in enumerate(lay.sbp)))
        full = math.prod(compute.local_shape(shape, rank))
        if isinstance(lay.sbp[data_axis], gt.sbp.Split):
            ag = (full - math.prod(stored)) * F64
            out[("forward", "all_gather", data_axis)] += ag
            if stage == 3:
                out[("backward", "all_gather", data_axis)] += ag
            out[("backward", "reduce_scatter", data_axis)] += (d - 1) * math.prod(stored) * F64
        else:
            me = p.group(rank, data_axis).index(rank)
            out[("backward", "all_reduce", data_axis)] += all_reduce_recv_bytes(full, F64, d, me)
    p = layouts[0][1].placement
    if p.shape[data_axis] > 1:
        group = p.group(rank, data_axis)
        out[("forward", "all_reduce", data_axis)] += all_reduce_recv_bytes(1, F64, len(group), group.index(rank))
    return out


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_zero_trains_as_one_device_at_the_paper_bytes(shape, stage):
    steps = 20
    want_losses, want_state = _reference(steps, "adamw", None)
    gt.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        results = gt.launch(_global_run, math.prod(shape), args=(shape, stage, steps, "adamw", None))
    psi = sum(q.numel() for q in GPT(CFG).parameters())  # the tied embedding/head counted once
    for rank, (losses, state, counted, layouts, fallback) in enumerate(results):
        assert fallback == {}
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-10)
        for k, v in want_state.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-10, msg=k)
        want = zero_bytes(layouts, stage, rank)
        data_got = [Counter({k: v for k, v in c.items() if k[2] == 0}) for c in counted]
        for c in data_got:  # every step the same: nothing else moves on the data axis
            assert c == want
        if len(shape) == 1:  # the textbook count, 3 (or 2) Psi (n-1)/n, for even shards
            n = shape[0]
            zero_moved = sum(v for k, v in want.items() if k[1] != "all_reduce")
            assert zero_moved == stage * psi * (n - 1) // n * F64
            assert all(k[1] != "all_reduce" or k[0] == "forward" for k in want)
        else:  # the tensor axis moves exactly what Megatron TP moves (tests/test_gpt_comm.py)
            from test_gpt_comm import megatron
            tp = Counter({(k[0], k[1], k[2]): v * F64 // 4 for k, v in megatron(shape, []).items()  # it counts fp32
                          if k[3] == "b" and k[2] == 1})
            got_tp = Counter({k: v for k, v in counted[-1].items() if k[2] == 1})
            assert got_tp == tp


@pytest.mark.parametrize("opt_kind,clip", [("sgd", None), ("sgd", "foreach"), ("adamw-loop", "loop"),
                                           ("adam", None)])
def test_zero3_optimizers_and_clipping_as_one_device(opt_kind, clip):
    """SGD with momentum, Adam, AdamW's for-loop path, clip_grad_norm_ (foreach: the norms of all
    sharded gradients in one small all-reduce; the default path: one scalar all-reduce per gradient)."""
    steps = 6
    want_losses, want_state = _reference(steps, opt_kind, clip)
    gt.reset_stats()
    results = gt.launch(_global_run, 2, args=((2,), 3, steps, opt_kind, clip))
    n_params = len(list(GPT(CFG).parameters()))  # the tied embedding/head once
    for losses, state, counted, layouts, fallback in results:
        assert fallback == {}
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-10)
        for k, v in want_state.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-10, msg=k)
        step = Counter({k: v for k, v in counted[-1].items() if k[0] == "step"})
        if clip == "foreach":
            assert step == Counter({("step", "all_reduce", 0): all_reduce_recv_bytes(n_params, F64, 2, 0)})
        elif clip == "loop":
            assert step == Counter({("step", "all_reduce", 0): n_params * all_reduce_recv_bytes(1, F64, 2, 0)})
        else:
            assert step == Counter()


def _zero_gpt(reshard_after_forward: bool = True):
    """The fp64 GPT under zero_plan on 2 ranks: (placement, model, the root's and one block's parameter
    bytes, which a gather holds)."""
    p = _mesh((2,))
    torch.manual_seed(0)
    model = GPT(CFG).double()
    sizes = {n: m_.numel() * F64 for n, m_ in model.named_parameters()}
    root = sum(v for k, v in sizes.items() if not k.startswith("blocks."))
    block = sum(v for k, v in sizes.items() if k.startswith("blocks.0."))
    gt.to_global(model, p, zero_plan(0, 1, reshard_after_forward=reshard_after_forward))
    return p, model, root, block


def test_zero3_frees_gathered_parameters_between_forward_and_backward():
    """ZeRO-3 holds at most the root's and one block's gathered parameters during the forward and
    none after it; ZeRO-2 holds every gathered parameter from the forward to its module's backward.
    Model-state bytes per rank (parameters, gradients, AdamW state) are the ZeRO formula's 16 Psi / N."""
    def run(stage):
        p, model, root, block = _zero_gpt(reshard_after_forward=stage == 3)
        peaks = []
        for b in model.blocks:
            b.mlp.register_forward_hook(lambda *a: peaks.append(zero.gathered_bytes()))  # inside the block
        idx, tgt = (gt.to_global(t, p, gt.split(0)) for t in (_tokens(1), _tokens(2)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = model(idx, tgt)[1]
        after_forward = zero.gathered_bytes()
        loss.backward()
        after_backward = zero.gathered_bytes()
        opt.step()
        state = sum(t._local.numel() * F64 for q in model.parameters()
                    for t in [q, q.grad, opt.state[q]["exp_avg"], opt.state[q]["exp_avg_sq"]])
        psi = sum(q.numel() for q in model.parameters())
        return peaks, after_forward, after_backward, root, block, state, psi
    for stage in (2, 3):
        results = gt.launch(run, 2, args=(stage,))
        psi = results[0][-1]
        assert sum(r[5] for r in results) == 4 * psi * F64  # every element of the model state held once
        for peaks, after_forward, after_backward, root, block, state, psi in results:
            assert after_backward == 0
            assert state <= 1.02 * 4 * psi * F64 / 2  # (param + grad + 2 AdamW moments) Psi / N
            if stage == 3:
                assert max(peaks) == root + block and after_forward == 0
            else:
                assert after_forward == root + CFG.n_layer * block


def test_zero3_backward_starts_each_regather_one_module_ahead(monkeypatch):
    """FSDP2's backward prefetch: when the backward enters a module, the gather of the module whose
    backward comes next (the one whose forward ended before) starts; so every re-gather but the
    first finds its collective already started. Nothing else changes: the bytes are the same."""
    seen = []
    regather = zero._Call.regather

    def spy(call):
        if call.freed:
            seen.append((gt.rank(), call.group.where.split("on ")[-1], call.pending is not None))
        regather(call)
    monkeypatch.setattr(zero._Call, "regather", spy)

    def run():
        p = _mesh((2,))
        torch.manual_seed(0)
        model = gt.to_global(GPT(CFG).double(), p, zero_plan(0, 1))
        idx, tgt = (gt.to_global(t, p, gt.split(0)) for t in (_tokens(1), _tokens(2)))
        for _ in range(2):
            model(idx, tgt)[1].backward()
            assert zero.gathered_bytes() == 0
    gt.launch(run, 2)
    blocks = [f"'blocks.{i}'" for i in reversed(range(CFG.n_layer))]
    for rank in (0, 1):
        mine = [(where, ahead) for r, where, ahead in seen if r == rank]
        assert mine == 2 * ([("'the root module'", False)] + [(b, True) for b in blocks]), mine


@pytest.mark.parametrize("in_flight", [0, 1])  # CPU's default, GPU's
def test_zero3_reduction_starts_with_only_the_next_module_gathered(monkeypatch, in_flight):
    """The peak of a ZeRO-3 backward is where a module's reduce-scatter makes its buffers. By then the
    module's own gathered copies are freed, the next module's prefetched gather is finished into its
    parameters (no all-gather buffers left in flight beside the reduction's), and the previous module's
    gradients are no longer held by the reduction still in flight. Counted exactly: at each reduction the
    live gathered bytes are the root's and the next block's; whenever the backward enters a module, the
    gradients of the reduction started last are dead."""
    import weakref
    seen = []
    reduce_start = zero._Call.reduce_start

    def spy(call, grads):
        live = [c for c in list(zero._LIVE) if c.rank == gt.rank() and not c.freed]
        dead = all(r() is None for r in _GRADS.get(gt.rank(), []))
        seen.append((gt.rank(), call.group.where.split("on ")[-1], zero.gathered_bytes(),
                     sorted(c.group.where.split("on ")[-1] for c in live),
                     any(c.pending is not None for c in list(zero._LIVE) if c.rank == gt.rank()), dead))
        _GRADS[gt.rank()] = [weakref.ref(g) for g in grads if g is not None]
        return reduce_start(call, grads)
    _GRADS: dict = {}
    monkeypatch.setattr(zero._Call, "reduce_start", spy)
    monkeypatch.setattr(zero, "MAX_IN_FLIGHT", in_flight)
    regather, checked = zero._Call.regather, []

    def entering(call):  # the backward enters a module: the reduction started before it is still in flight
        if _GRADS.get(gt.rank()):
            checked.append(all(r() is None for r in _GRADS[gt.rank()]))
        regather(call)
    monkeypatch.setattr(zero._Call, "regather", entering)

    def run():
        p, model, root, block = _zero_gpt()
        idx, tgt = (gt.to_global(t, p, gt.split(0)) for t in (_tokens(1), _tokens(2)))
        model(idx, tgt)[1].backward()
        return root, block
    root, block = gt.launch(run, 2)[0]
    for rank in (0, 1):
        mine = [s_[1:] for s_ in seen if s_[0] == rank]
        assert mine == [("'blocks.1'", root + block, ["'blocks.0'", "'the root module'"], False, True),
                        ("'blocks.0'", root, ["'the root module'"], False, True),
                        ("'the root module'", 0, [], False, True)], mine
    assert checked and all(checked), checked


def _step_after_a_dropped_forward(drop_first: bool):
    p = _mesh((2,))
    torch.manual_seed(0)
    model = gt.to_global(GPT(CFG).double(), p, zero_plan(0, 1))
    idx, tgt = (gt.to_global(t, p, gt.split(0)) for t in (_tokens(1), _tokens(2)))
    if drop_first:
        model(idx, tgt)  # grad enabled, never backpropagated: its graph is dropped here
    with gt.comm_log() as log:
        model(idx, tgt)[1].backward()
    return sum(e.recv_bytes for e in log.events if e.kind == "all_gather")


def test_a_forward_never_backpropagated_leaves_nothing_to_prefetch():
    """The backward's prefetch links are weak: a dropped forward's modules are not gathered again by the
    next backward (which would move bytes nobody reads and leave a collective unfinished)."""
    assert gt.launch(_step_after_a_dropped_forward, 2, args=(True,)) == \
        gt.launch(_step_after_a_dropped_forward, 2, args=(False,))


def _accumulated(stage: int, micro: int, scoped: bool):
    """One step of `micro` micro-batches (gradient accumulation), optionally inside zero.accumulating()."""
    p = _mesh((2,))
    torch.manual_seed(0)
    model = gt.to_global(GPT(CFG).double(), p, zero_plan(0, 1, reshard_after_forward=stage == 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, tgt = _tokens(1), _tokens(2)
    with gt.comm_log() as log:
        with zero.accumulating() if scoped else contextlib.nullcontext():
            for xs, ts in zip(idx.tensor_split(micro), tgt.tensor_split(micro)):
                xs, ts = (gt.to_global(t, p, gt.split(0)) for t in (xs, ts))
                (model(xs, ts)[1] * (xs.shape[0] / idx.shape[0])).backward()
    moved = Counter()
    for e in log.events:
        moved[e.kind] += e.recv_bytes
    opt.step()
    return moved, {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulating_micro_batches_gathers_and_reduces_zero2_once_per_step(stage):
    """Gradient accumulation over 4 micro-batches. Inside `zero.accumulating()` a ZeRO-2 module gathers
    its parameters once and reduce-scatters their summed gradients once (FSDP2's deferred gradient
    sync): the bytes of one micro-batch's step; ZeRO-3 still gathers and reduces per micro-batch (its
    memory bound: no full-size gradient kept between micro-batches). Values equal one device either way."""
    micro = 4
    torch.manual_seed(0)
    ref = GPT(CFG).double()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    idx, tgt = _tokens(1), _tokens(2)
    for xs, ts in zip(idx.tensor_split(micro), tgt.tensor_split(micro)):
        (ref(xs, ts)[1] * (xs.shape[0] / idx.shape[0])).backward()
    opt.step()
    once = gt.launch(_accumulated, 2, args=(stage, 1, False))
    plain = gt.launch(_accumulated, 2, args=(stage, micro, False))
    scoped = gt.launch(_accumulated, 2, args=(stage, micro, True))
    for (one, _), (each, _), (kept, state) in zip(once, plain, scoped):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-10, msg=k)
        assert each["all_gather"] == micro * one["all_gather"]
        assert each["reduce_scatter"] == micro * one["reduce_scatter"]
        times = 1 if stage == 2 else micro
        assert kept["reduce_scatter"] == times * one["reduce_scatter"]
        assert kept["all_gather"] == times * one["all_gather"]


class _Tiny(nn.Module):
    """Uneven dims: some smaller than the mesh."""

    def __init__(self, dims: list) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.norm = nn.LayerNorm(dims[-1])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def _owner(name: str, gathered: list):
    """The outermost gathering module a parameter is under (None: not gathered)."""
    for g in sorted(gathered, key=len):
        if g == "" or name.startswith(g + "."):
            return g
    return None


def _tiny_run(dims, gathered, stage, mesh_shape, steps, world):
    """Parameters of gathering modules stored split on the data axis; the others Broadcast (data parallel)."""
    torch.manual_seed(0)
    model = _Tiny(dims).double()
    x = torch.randn(6, dims[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if mesh_shape is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(steps):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach() for k, v in model.state_dict().items()}, None
    p = _mesh(mesh_shape)
    data = tuple(gt.split(0) if a == 0 else B for a in range(len(mesh_shape)))
    hint = gt.ModuleLayout(params=tuple(B if a == 0 else None for a in range(len(mesh_shape))),
                           reshard_after_forward=stage == 3)
    plan = {name: data for name, _ in model.named_parameters() if _owner(name, gathered) is not None}
    plan.update({name: hint for name in gathered})
    gt.to_global(model, p, plan)
    gx = gt.to_global(x, p, data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        with gt.comm_log() as log:
            model(gx).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    layouts = {n: (tuple(q.shape), q.global_layout) for n, q in model.named_parameters()}
    return {k: v.full_tensor() for k, v in model.state_dict().items()}, (log.events, layouts)


@settings(deadline=None)
@given(dims=st.lists(st.integers(1, 7), min_size=2, max_size=4),
       gathered=st.sets(st.sampled_from(["layers.0", "layers.1", "layers.2", "norm"])),
       stage=st.sampled_from([2, 3]),
       mesh_shape=st.sampled_from([(2,), (3,), (2, 2), (3, 1)]))
def test_zero_hypothesis_uneven_parameters_and_groups(dims, gathered, stage, mesh_shape):
    """Meshes, uneven parameter sizes (dims smaller than the mesh), any set of gathering submodules
    (the root gathers the rest: a parameter left Broadcast has its gradient reduced where the
    per-op choice finds it cheapest, which is data parallelism's business, not ZeRO's):
    values equal one device; the data axis moves exactly the gathers and reduce-scatters of the
    gathered parameters (their compute shards less their stored ones, and (d-1) x their stored
    shards); nothing else moves in the forward and backward (the other parameters' gradients are
    reduced when the optimizer reads them)."""
    gathered = [""] + sorted(g for g in gathered if g == "norm" or int(g[-1]) < len(dims) - 1)
    want, _ = _tiny_run(dims, gathered, stage, None, 2, 1)
    n = math.prod(mesh_shape)
    results = gt.launch(_tiny_run, n, args=(dims, gathered, stage, mesh_shape, 2, n))
    for rank, (state, (events, layouts)) in enumerate(results):
        for k, v in want.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-10, msg=k)
        assert {e.kind for e in events} <= {"all_gather", "reduce_scatter"}
        got_gather = sum(e.recv_bytes for e in events if e.kind == "all_gather")
        got_rs = sum(e.recv_bytes for e in events if e.kind == "reduce_scatter")

        want_gather = want_rs = 0
        for name, (shape, lay) in layouts.items():
            if _owner(name, gathered) is None or lay.placement.shape[0] == 1:
                continue
            compute = gt.Layout(lay.placement, (B,) + lay.sbp[1:])
            ag = (math.prod(compute.local_shape(shape, rank)) - math.prod(lay.local_shape(shape, rank))) * F64
            want_gather += ag * (2 if stage == 3 else 1)
            want_rs += (lay.placement.shape[0] - 1) * math.prod(lay.local_shape(shape, rank)) * F64
        assert got_gather == want_gather
        assert got_rs == want_rs


def test_a_model_nobody_here_wrote_converts_to_zero3_with_a_plan_alone():
    """torch's test Transformer: every parameter S(0), each layer and the root gathered."""
    from thirdparty.torch_test_transformer import ModelArgs, Transformer
    args = ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)
    tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(5))

    def train(p=None):
        torch.manual_seed(0)
        model = Transformer(args).double()
        tok, tgt = tokens, targets
        if p is not None:
            hint = gt.ModuleLayout(params=B)
            gt.to_global(model, p, {"*": gt.split(0), "": hint, "layers.*": hint})
            tok, tgt = gt.to_global(tokens, p, gt.split(0)), gt.to_global(targets, p, gt.split(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            F.cross_entropy(model(tok).reshape(-1, 16), tgt.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        return {k: (v.full_tensor() if p is not None else v.detach()) for k, v in model.state_dict().items()}
    want = train()
    for state in gt.launch(lambda: train(gt.placement("cpu", [0, 1])), 2):
        for k, v in want.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-10, msg=k)


def test_mixed_precision_gathers_bf16_and_keeps_fp32_master_weights():
    """param_dtype=bf16: the gathers move half the bytes, the module computes in bf16, the stored
    parameters, gradients and optimizer state stay fp32; gradients reduced in fp32 (reduce_dtype)."""
    def run():
        p = _mesh((2,))
        torch.manual_seed(0)
        model = gt.to_global(GPT(CFG), p, zero_plan(0, 1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        idx, tgt = (gt.to_global(t, p, gt.split(0)) for t in (_tokens(1), _tokens(2)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            with gt.comm_log() as log:
                loss = model(idx, tgt)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.full_tensor().detach()))
        gathers = sum(e.recv_bytes for e in log.events if e.kind == "all_gather")
        dtypes = {q.dtype for q in model.parameters()} | {opt.state[q]["exp_avg"].dtype for q in model.parameters()}
        return losses, gathers, dtypes, loss.dtype, sum(q.numel() for q in model.parameters())
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref_losses = []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        loss = ref(_tokens(1), _tokens(2))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    for losses, gathers, dtypes, loss_dtype, psi in gt.launch(run, 2):
        assert gathers == psi // 2 * 2  # bf16: 2 bytes an element, half the parameters received
        assert dtypes == {torch.float32} and loss_dtype == torch.bfloat16
        np.testing.assert_allclose(losses, ref_losses, rtol=3e-2)


def test_zero_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"plan\['layers'\].*never called.*layers\.\*"):
        gt.to_global(_Tiny([2, 2, 2]), gt.placement("cpu", [0]), {"layers": gt.ModuleLayout(params=B)})
    with pytest.raises(TypeError, match="param_dtype"):
        gt.ModuleLayout(params=B, param_dtype=torch.int32)
    with pytest.raises(ValueError, match="param_dtype.*needs params"):
        gt.ModuleLayout(output=B, param_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        gt.ModuleLayout(params=B, reshard_after_forward="yes")

    def other_mesh():
        p, q = gt.placement("cpu", [0, 1]), gt.placement("cpu", [[0], [1]])
        with pytest.raises(ValueError, match=r"params.*mesh"):  # another placement of the same mesh shape is a stage
            gt.to_global(nn.Linear(4, 4), p, {"*": gt.split(0), "": gt.ModuleLayout(params=gt.Layout(q, (B, B)))})
        with pytest.raises(ValueError, match="params"):
            gt.to_global(nn.Linear(4, 4), p, {"*": gt.split(0), "": gt.ModuleLayout(params=(B, B))})
        with pytest.raises(ValueError, match="Partial"):
            gt.to_global(nn.Linear(4, 4), p, {"*": gt.split(0), "": gt.ModuleLayout(params=gt.partial_sum)})
    gt.launch(other_mesh, 2)


@pytest.mark.gloo
@pytest.mark.parametrize("shape,stage", [((2,), 3), ((4,), 2)])
def test_gpt_zero_under_gloo_processes(shape, stage):
    """The same training and bytes on real processes (2 ranks ZeRO-3, 4 ranks ZeRO-2)."""
    steps = 3
    want_losses, want_state = _reference(steps, "adamw", None)
    results = gt.launch(_global_run, math.prod(shape), args=(shape, stage, steps, "adamw", None),
                        backend="gloo", timeout=120)
    for rank, (losses, state, counted, layouts, fallback) in enumerate(results):
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-10)
        for k, v in want_state.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-10, msg=k)
        assert all(c == zero_bytes(layouts, stage, rank) for c in counted)
