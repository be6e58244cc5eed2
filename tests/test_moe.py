"""The grouped (GShard/Switch) MoE of models/moe.py under ep_plan equals one device, at exactly the
ideal all-to-all bytes, with no op falling back.

Ideal bytes per MoE layer and direction: two all-to-alls of the dispatched [E, G, C, d] tensor
(dispatch S(G) -> S(E), combine S(E) -> S(G); the backward runs the duals). A rank receives what its
target shard holds and its source shard does not: E_r x (G - G_r) x C x d elements, which for even
splits is (n-1)/n^2 of the tensor.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import globaltensor as gt
from globaltensor.models.moe import MoE, MoEConfig, MoEGPT, capacity, ep_batch, ep_plan, moe_gpt_plan
from thirdparty.torch_test_transformer import ModelArgs, Transformer, requires_experts

TOL = dict(rtol=1e-10, atol=1e-10)
CFG = MoEConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, expert_hidden=32, n_expert=4,
                top_k=2, capacity_factor=1.0)
BATCH = 4


def _launch(fn, n, *args, backend="sim"):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns: none may happen
        return gt.launch(fn, n, args=args, backend=backend, timeout=120 if backend == "gloo" else None)


def _split_sizes(n: int, parts: int) -> list[int]:
    return [len(a) for a in np.array_split(np.arange(n), parts)]


def ideal_all_to_all(cfg: MoEConfig, groups: int, group_size: int, ranks: int, itemsize: int = 8) -> list[tuple]:
    """Bytes each rank of the expert axis receives in the dispatch S(G) -> S(E) and the combine
    S(E) -> S(G) all-to-all of [E, G, C, d]: what its target shard holds and its source shard does not
    (equal, (n-1)/n^2 of the tensor, when E and G divide over the ranks)."""
    c = capacity(cfg, group_size)
    es, gs = _split_sizes(cfg.n_expert, ranks), _split_sizes(groups, ranks)
    unit = c * cfg.n_embd * itemsize
    return [(es[r] * (groups - gs[r]) * unit, gs[r] * (cfg.n_expert - es[r]) * unit) for r in range(ranks)]


# -- one layer ----------------------------------------------------------------------------------------

def _layer_inputs(cfg: MoEConfig, batch: int, seed: int, skew):
    """A layer and its input and loss weights. skew=True (or "equal"): equal router probabilities, so topk
    picks experts 0..k-1 for every token and the rest get none. skew="hot": every token's first choice
    is the last expert and none ever picks expert 0 (feature 0 of every token is +20, and only those two
    experts' router weights read it, +1 and -1), the other choices routed as drawn: one expert gets
    every token under top-2 too, and another none."""
    torch.manual_seed(seed)
    layer = MoE(cfg).double()
    if skew is True or skew == "equal":
        torch.nn.init.zeros_(layer.gate.weight)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, cfg.block_size, cfg.n_embd, generator=g, dtype=torch.float64)
    w = torch.randn(batch, cfg.block_size, cfg.n_embd, generator=g, dtype=torch.float64)
    if skew == "hot":
        with torch.no_grad():
            layer.gate.weight[:, 0] = 0.0
            layer.gate.weight[0, 0] = -1.0
            layer.gate.weight[-1, 0] = 1.0
        x[..., 0] += 20.0
    return layer, x, w


def _layer_step(cfg, batch, seed, skew, mesh, expert_axis):
    layer, x, w = _layer_inputs(cfg, batch, seed, skew)
    p = gt.placement("cpu", np.arange(int(np.prod(mesh))).reshape(mesh).tolist())
    gt.to_global(layer, p, ep_plan(expert_axis, len(mesh)))
    x = gt.to_global(x, p, ep_batch(len(mesh))).requires_grad_(True)
    w = gt.to_global(w, p, ep_batch(len(mesh)))
    with gt.comm_log() as fwd:
        y, aux = layer(x)
    loss = (y * w).sum() + aux
    with gt.comm_log() as bwd:
        loss.backward()
    grads = {k: v.grad.full_tensor() for k, v in layer.named_parameters()}
    return ([(e.kind, e.recv_bytes) for e in fwd.events], [(e.kind, e.recv_bytes) for e in bwd.events],
            y.full_tensor(), aux.full_tensor(), layer.last_kept.full_tensor(), x.grad.full_tensor(), grads)


def _layer_reference(cfg, batch, seed, skew):
    layer, x, w = _layer_inputs(cfg, batch, seed, skew)
    x.requires_grad_(True)
    y, aux = layer(x)
    ((y * w).sum() + aux).backward()
    return y.detach(), aux.detach(), layer.last_kept, x.grad, {k: v.grad for k, v in layer.named_parameters()}


def _cut(length: int, mesh: tuple, axes: list, coord, unit: int = 1) -> tuple:
    """The [lo, hi) of a dim of `length` a rank at `coord` holds when mesh `axes` split it, in order
    (each axis splits the piece the axes before it left, balanced), in whole units of `unit` (the
    groups of one sequence: [B, T, d] split on B, reshaped to [G, S, d], keeps each sequence's groups
    on the rank of the sequence)."""
    lo, hi = 0, length // unit
    for a in axes:
        sizes = _split_sizes(hi - lo, mesh[a])
        lo += sum(sizes[:coord[a]])
        hi = lo + sizes[coord[a]]
    return lo * unit, hi * unit


def per_sequence(cfg: MoEConfig) -> int:
    """Routing groups per sequence: the unit in which a batch split cuts the groups."""
    s = cfg.group_size or cfg.block_size
    return cfg.block_size // s if cfg.block_size % s == 0 else 1


def ideal_moe_bytes(cfg: MoEConfig, groups: int, group_size: int, mesh: tuple, expert_axis: int, coord) -> tuple:
    """Bytes the rank at `coord` receives in the dispatch (the router's layout of [E, G, C, d]: G split
    by every mesh axis in order -> the experts': E split by the expert axis, G by the others) and in the
    combine (back): what its target block holds and its source block does not, any mesh and uneven splits
    (ideal_all_to_all when the expert axis is the last)."""
    axes = list(range(len(mesh)))
    others = [a for a in axes if a != expert_axis]
    u = per_sequence(cfg)
    routed = ((0, cfg.n_expert), _cut(groups, mesh, axes, coord, u))
    experts = (_cut(cfg.n_expert, mesh, [expert_axis], coord), _cut(groups, mesh, others, coord, u))
    size = lambda blk: (blk[0][1] - blk[0][0]) * (blk[1][1] - blk[1][0])  # noqa: E731
    both = tuple((max(a[0], b[0]), max(min(a[1], b[1]), max(a[0], b[0]))) for a, b in zip(routed, experts))
    unit = capacity(cfg, group_size) * cfg.n_embd * 8
    return (size(experts) - size(both)) * unit, (size(routed) - size(both)) * unit


def without_aux_gather(events: list, groups: int, mesh: tuple, coord, unit: int = 1) -> list:
    """The forward's collectives less the aux loss's one small reduction where there are fewer groups than
    ranks: the planner then gathers the [G] per-group loss terms (at most 8 bytes for each this rank lacks)
    rather than owe the all-reduce of a Partial scalar, which would receive more; a single group held by
    one rank of a 2-D mesh is broadcast from it instead (the same 8 bytes)."""
    lo, hi = _cut(groups, mesh, list(range(len(mesh))), coord, unit)
    small = [i for i, (kind, b) in enumerate(events)
             if kind in ("all_gather", "broadcast") and b <= 8 * (groups - (hi - lo))]
    if groups >= int(np.prod(mesh)) or not small:
        return events
    return events[:small[-1]] + events[small[-1] + 1:]   # the last: a count exchange may read the same


def check_layer(cfg: MoEConfig, batch: int, mesh: tuple, expert_axis: int = 0, seed: int = 0, skew=False):
    """Values and routing equal one device, nothing falls back; forward and backward each move exactly
    the dispatch's and the combine's ideal bytes (the backward: the combine's dual, then the dispatch's),
    one collective each: an all-to-all within the expert axis when the other axes come first (a
    send/recv when the expert axis also re-cuts the other axes' groups), group counts that do not divide
    over the ranks included (test_groups_that_do_not_divide). A conversion that moves nothing on any rank
    runs no collective; with fewer groups than ranks the aux loss may gather its [G] terms
    (without_aux_gather)."""
    before = dict(gt.stats()["fallback"])
    n = int(np.prod(mesh))
    results = _launch(_layer_step, n, cfg, batch, seed, skew, mesh, expert_axis)
    assert dict(gt.stats()["fallback"]) == before
    y_ref, aux_ref, kept_ref, xg_ref, g_ref = _layer_reference(cfg, batch, seed, skew)
    s = cfg.group_size or cfg.block_size
    groups = batch * cfg.block_size // s
    m = mesh[expert_axis]
    kind = "all_to_all" if expert_axis == len(mesh) - 1 else "send_recv"
    coords = [np.argwhere(np.arange(n).reshape(mesh) == r)[0] for r in range(n)]
    ideal = [ideal_moe_bytes(cfg, groups, s, mesh, expert_axis, c) for c in coords]
    moved = [any(b[i] for b in ideal) for i in range(2)]   # a conversion that moves nothing anywhere runs no collective
    for rank, (fwd, bwd, y, aux, kept, xg, grads) in enumerate(results):
        torch.testing.assert_close(y, y_ref, **TOL)
        torch.testing.assert_close(aux, aux_ref, **TOL)
        assert torch.equal(kept, kept_ref)
        torch.testing.assert_close(xg, xg_ref, **TOL)
        for k, g in grads.items():
            torch.testing.assert_close(g, g_ref[k], **TOL, msg=k)
        coord = coords[rank]
        want = [(kind, b) for b, runs in zip(ideal[rank], moved) if runs]
        if m == 1:
            continue
        if kind == "send_recv":  # point to point: a rank that receives nothing may take no part
            want, fwd, bwd = ([e for e in events if e[1]] for events in (want, fwd, bwd))
        assert want in (fwd, without_aux_gather(fwd, groups, mesh, coord, per_sequence(cfg))), (rank, fwd, want)
        assert bwd == want, (rank, bwd, want)
    return results


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("k", [1, 2])
def test_layer_equals_one_device_at_ideal_bytes(n, k):
    cfg = MoEConfig(**{**CFG.__dict__, "top_k": k})
    results = check_layer(cfg, BATCH, (n,))
    c = capacity(cfg, cfg.block_size)
    ecd = cfg.n_expert * BATCH * c * cfg.n_embd * 8     # the dispatched [E, G, C, d] tensor, bytes
    for fwd, bwd, *_ in results:                         # spelled out: (n-1)/n^2 of it, per all-to-all
        assert fwd == bwd == [("all_to_all", (n - 1) * ecd // n ** 2)] * 2


def test_dropless_by_padding_drops_nothing():
    """capacity_factor=None: every choice of every token gets a slot, skewed routing included."""
    cfg = MoEConfig(**{**CFG.__dict__, "capacity_factor": None})
    for skew in (False, True):
        kept = check_layer(cfg, BATCH, (2,), skew=skew)[0][4]
        assert kept.eq(1).all()


def test_layer_ep_x_dp_2x2():
    """DeepSpeed-MoE: tokens split on both axes, experts split on axis 1 and replicated on axis 0: the
    all-to-alls run within axis 1, on each data slice's tokens."""
    check_layer(CFG, BATCH, (2, 2), expert_axis=1)


def _layer_step_tp(cfg, batch):
    """One layer on EP=2 (axis 0) x TP=2 (axis 1): collectives forward and backward, values, routing."""
    layer, x, w = _layer_inputs(cfg, batch, 0, False)
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    gt.to_global(layer, p, ep_plan(0, 2, tensor_axis=1, dropless=cfg.dropless))
    x = gt.to_global(x, p, ep_batch(2, tensor_axis=1)).requires_grad_(True)
    w = gt.to_global(w, p, ep_batch(2, tensor_axis=1))
    with gt.comm_log() as fwd:
        y, aux = layer(x)
    with gt.comm_log() as bwd:
        ((y * w).sum() + aux).backward()
    grads = {k: v.grad.full_tensor() for k, v in layer.named_parameters()}
    choice = layer.last_choice.full_tensor() if cfg.dropless else None
    return ([(e.kind, e.recv_bytes) for e in fwd.events], [(e.kind, e.recv_bytes) for e in bwd.events],
            y.full_tensor(), x.grad.full_tensor(), grads, choice)


def test_layer_ep_x_tp_2x2():
    """EP=2 (axis 0) x TP=2 (axis 1, each expert Megatron-split): equal to one device, and each direction
    moves exactly what the planner finds, less than Megatron's count (the two expert-axis all-to-alls
    plus an all-reduce of the experts' [E/2, G, C, d] on the tensor axis). With X the bytes of that
    [E/2, G, C, d] (= of [E, G/2, C, d]) and D, K the 1-D ideal dispatch and combine on the expert axis:
    forward the dispatch (D), a reduce-scatter of the second layer's Partial output on the tensor axis
    (X/2), the combine of each tensor rank's half (K/2), an all-gather of the halves (X/2); backward the
    combine's dual (K), Megatron's all-reduce of the first layer's input gradient (X), the dispatch's
    dual on each tensor rank's half (D/2), then only the router's backward, a few hundred bytes (each no
    more than its [G, S, E] probabilities, as in the dropless EP x TP layer; D + K + X in all at most)."""
    before = dict(gt.stats()["fallback"])
    results = _launch(_layer_step_tp, 4, CFG, BATCH)
    assert dict(gt.stats()["fallback"]) == before
    y_ref, _, _, xg_ref, g_ref = _layer_reference(CFG, BATCH, 0, False)
    dispatch, combine = ideal_all_to_all(CFG, BATCH, CFG.block_size, 2)[0]
    x = CFG.n_expert // 2 * BATCH * capacity(CFG, CFG.block_size) * CFG.n_embd * 8
    probs = BATCH * CFG.block_size * CFG.n_expert * 8
    for rank, (fwd, bwd, y, xg, grads, _) in enumerate(results):
        torch.testing.assert_close(y, y_ref, **TOL)
        torch.testing.assert_close(xg, xg_ref, **TOL)
        for k, g in grads.items():
            torch.testing.assert_close(g, g_ref[k], **TOL, msg=k)
        assert fwd == [("all_to_all", dispatch), ("reduce_scatter", x // 2), ("all_to_all", combine // 2),
                       ("all_gather", x // 2)], (rank, fwd)
        assert bwd[:3] == [("all_to_all", combine), ("all_reduce", x), ("all_to_all", dispatch // 2)], (rank, bwd)
        assert all(b <= probs for _, b in bwd[3:]), (rank, bwd)
        assert sum(b for _, b in bwd) <= dispatch + combine + x, (rank, bwd)   # and Megatron's count at most


MESHES = [((2,), 0), ((3,), 0), ((4,), 0), ((2, 2), 1), ((2, 2), 0)]   # (mesh, expert axis): EP, EP x DP
SKEWS = [False, "equal", "hot"]


@settings(max_examples=max(12, settings.default.max_examples * 2 // 3), deadline=None)   # 12 in CI
@given(k=st.sampled_from([1, 2]), factor=st.sampled_from([0.5, 1.0, 1.25, 2.0, None]), experts=st.integers(1, 6),
       mesh=st.sampled_from(MESHES), per_rank=st.integers(1, 2), short=st.sampled_from([0, 0, 1, 2, 3]),
       group=st.sampled_from([None, 4]), skew=st.sampled_from(SKEWS), seed=st.integers(0, 3))
@example(k=1, factor=0.5, experts=1, mesh=((2, 2), 1), per_rank=1, short=2, group=4, skew=False, seed=0)  # dev: 0-byte all-to-alls
@example(k=1, factor=0.5, experts=1, mesh=((2, 2), 1), per_rank=1, short=1, group=4, skew=False, seed=0)  # one group moves
@example(k=2, factor=1.0, experts=4, mesh=((2,), 0), per_rank=2, short=1, group=4, skew=False, seed=0)  # G 4+2 groups
@example(k=2, factor=1.25, experts=6, mesh=((2, 2), 1), per_rank=2, short=3, group=4, skew="hot", seed=1)  # 5 seqs, nested
@example(k=2, factor=1.0, experts=5, mesh=((2, 2), 0), per_rank=2, short=2, group=4, skew=False, seed=0)  # expert axis first
@example(k=2, factor=1.25, experts=4, mesh=((2,), 0), per_rank=1, short=1, group=None, skew=False, seed=0)  # one group
@example(k=1, factor=1.0, experts=3, mesh=((2, 2), 1), per_rank=1, short=3, group=None, skew="hot", seed=1)  # one, 2x2
def test_layer_hypothesis(k, factor, experts, mesh, per_rank, short, group, skew, seed):
    """Top-1/2, capacity factors that drop and that pad (None: dropless by padding), E below / not a
    multiple of the expert axis (uneven or empty expert shards), EP on 1-D meshes and EP x DP on 2x2 (the
    expert axis last, DeepSpeed-MoE's, or first), every token's choices to the same experts ("equal") or
    every token to one expert with another empty under top-1 and top-2 ("hot"), group counts a multiple
    of the ranks (as GShard sizes them) or `short` of one (uneven, ranks with one group or none, 1-D and
    2x2), groups smaller than a sequence (two per sequence) with a batch that does not divide over the
    ranks (G ragged in units of a sequence's groups, which the router's ops keep: ideal_moe_bytes of that
    cut): values and routing equal one device, bytes exactly the ideal (check_layer, the whole layer; see
    test_groups_that_do_not_divide; with the expert axis first on 2x2 the experts' G cut on the other
    axis is the sequences re-cut over that axis alone: one send/recv across both axes), and a single group
    (batch 1: its size-1 G dim split puts it on the first rank, and reshapes carry that split to a size-1
    dim of their output, so the router runs there and the dispatch is the ideal all-to-all from it)."""
    mesh, expert_axis = mesh
    n = int(np.prod(mesh))
    batch = max(1, n * per_rank - min(short, n))
    k = min(k, experts)
    cfg = MoEConfig(**{**CFG.__dict__, "top_k": k, "capacity_factor": factor, "n_expert": experts,
                       "group_size": group})
    check_layer(cfg, batch, mesh, expert_axis, seed=seed, skew=skew)


@pytest.mark.parametrize("mesh, expert_axis, batch, experts", [((2,), 0, 3, 4), ((4,), 0, 6, 4), ((2, 2), 1, 7, 6)])
def test_groups_that_do_not_divide(mesh, expert_axis, batch, experts):
    """G not a multiple of the ranks (uneven G split: 2+1, 2+2+1+1; EP x DP 2x2, 7 groups, E = 6): values
    equal one device and the whole layer moves exactly the ideal bytes, the dispatch and the combine one
    collective each way (ideal_moe_bytes of the uneven split), nothing else. A balanced split of
    [G, S, d] on G is not one of [G*S, d] on rows, so the router's Linear (which flattens) and the
    experts' reshape ([E, G, C, d] -> [E, G*C, d]) see a ragged split of rows in units of S (or C), with
    no data moved (ops/view.py's uneven_merge), which their matrix products keep and the reshape back
    balances again. Before that the router reboxed its input and every choice downstream followed
    (n=2, G=3: 12 collectives forward where 2 do; on 2x2 send/recvs, reduce-scatters and all-gathers of
    several times the ideal)."""
    check_layer(MoEConfig(**{**CFG.__dict__, "n_expert": experts}), batch, mesh, expert_axis)


def _uneven_rows_step(mesh, batch):
    """A Linear over [G, S, d] split unevenly on G (no MoE): its collectives, output and gradients, and the
    flattened rows' layout; then ops that do not keep ragged rows (softmax over them, a cat) on the view."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4).double()
    x = torch.randn(batch, 8, 16, dtype=torch.float64)
    p = gt.placement("cpu", np.arange(int(np.prod(mesh))).reshape(mesh).tolist())
    gt.to_global(lin, p, {})
    xg = gt.to_global(x, p, ep_batch(len(mesh))).requires_grad_(True)
    with gt.comm_log() as log:
        y = lin(xg)
        rows = xg.reshape(-1, 16)
        y.sum().backward()
    other = (rows.softmax(0) * 2).sum(1)
    joined = torch.cat([rows, rows]).sum(0)
    return ([e.kind for e in log.events], type(rows).__name__, rows.sbp, y.full_tensor(), xg.grad.full_tensor(),
            lin.weight.grad.full_tensor(), rows.full_tensor(), other.full_tensor(), joined.full_tensor())


@pytest.mark.parametrize("mesh, batch", [((2,), 3), ((2, 2), 7), ((4,), 1)])
def test_a_reshape_of_an_uneven_split_is_ragged_rows(mesh, batch):
    """The rule under test_groups_that_do_not_divide, on its own: [G, S, d] split unevenly on G (nested on
    2x2; G = 1: 8 + 0 + 0 + 0 rows) reshaped to [G*S, d] is ragged on the rows, a Linear over it runs
    locally forward and backward (no collective), and ops that do not keep ragged rows get them balanced:
    values equal one device throughout."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4).double()
    x = torch.randn(batch, 8, 16, dtype=torch.float64, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    rows = x.detach().reshape(-1, 16)
    for kinds, kind, sbp, yg, xgrad, wgrad, r, other, joined in _launch(_uneven_rows_step, int(np.prod(mesh)),
                                                                       mesh, batch):
        assert kinds == [] and kind == "RaggedTensor" and sbp == (gt.ragged(0),) * len(mesh)
        torch.testing.assert_close(yg, y.detach(), **TOL)
        torch.testing.assert_close(xgrad, x.grad, **TOL)
        torch.testing.assert_close(wgrad, lin.weight.grad, **TOL)
        torch.testing.assert_close(r, rows, **TOL)
        torch.testing.assert_close(other, (rows.softmax(0) * 2).sum(1), **TOL)
        torch.testing.assert_close(joined, torch.cat([rows, rows]).sum(0), **TOL)


@pytest.mark.parametrize("bad, arg", [(dict(top_k=5), "top_k"), (dict(top_k=0), "top_k"),
                                      (dict(capacity_factor=0.0), "capacity_factor"), (dict(group_size=0), "group_size")])
def test_bad_config_names_the_argument(bad, arg):
    with pytest.raises(ValueError, match=arg):
        MoEConfig(**{**CFG.__dict__, **bad})


def test_groups_that_do_not_cut_the_tokens():
    layer = MoE(MoEConfig(**{**CFG.__dict__, "group_size": 3}))
    with pytest.raises(ValueError, match="group_size=3"):
        layer(torch.randn(2, CFG.block_size, CFG.n_embd))


# -- a MoE model nobody here wrote ---------------------------------------------------------------------

TRANSFORMER_STEPS = 3


def _torch_transformer(n, steps=TRANSFORMER_STEPS):
    """torch's test Transformer (experts S(0) on n ranks, tokens S(0); n = 0: one device): AdamW steps on
    the sum of its logits; the first step's output and gradients, each step's loss, the parameters after."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0,
                                  num_experts=4)).double()
    tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    if n:
        p = gt.placement("cpu", list(range(n)))
        gt.to_global(model, p, {"*.experts.*": gt.split(0)})
        tokens = gt.to_global(tokens, p, gt.split(0))
    whole = (lambda t: t.full_tensor()) if n else (lambda t: t)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        out = model(tokens)
        loss = out.double().sum()   # its logits are .float(): summed in fp64, the shards' order does not show
        loss.backward()
        if step == 0:
            first = whole(out).detach(), {k: whole(v.grad) for k, v in model.named_parameters()}
        losses.append(whole(loss).item())
        opt.step()
    return first + (losses, {k: whole(v).detach() for k, v in model.named_parameters()})


@pytest.fixture(scope="module")
def transformer_reference():
    return _torch_transformer(0)


@requires_experts
@pytest.mark.parametrize("n", [2, 4])
def test_torch_test_transformer_experts_by_plan_alone(transformer_reference, n):
    """torch's test Transformer with num_experts (every token through every expert, summed: no
    routing), written for one device, converts unchanged with the experts S(0) and tokens S(0), and
    equals one device with nothing falling back: the first step's output and gradients, and over 3
    AdamW steps each loss and the parameters after (the optimizer runs on the E-split experts). Its
    bytes are not the ideal: the experts' input is `x.expand(E, ...)`, split on tokens, which the next
    bmm boxes to E-split: an all-to-all of the expanded tensor, E/n times the all-gather of the tokens
    that DTensor's ExpertParallel runs (equal at E = n); choosing per op, the expand cannot see that
    gathering before it would be cheaper (a step plan sees it: next test)."""
    before = dict(gt.stats()["fallback"])
    results = _launch(_torch_transformer, n, n)
    assert dict(gt.stats()["fallback"]) == before
    want_out, want_grads, want_losses, want_params = transformer_reference
    for out, grads, losses, params in results:
        torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
        for k, g in grads.items():
            torch.testing.assert_close(g, want_grads[k], rtol=1e-10, atol=1e-12, msg=k)
        np.testing.assert_allclose(losses, want_losses, **TOL)
        for k, q in params.items():
            torch.testing.assert_close(q, want_params[k], **TOL, msg=k)


def _torch_transformer_steered(n):
    """The model of the test above, forward and backward twice under one step plan: the second run's
    bytes, and both runs' outputs and gradients."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0,
                                  num_experts=4)).double()
    p = gt.placement("cpu", list(range(n)))
    gt.to_global(model, p, {"*.experts.*": gt.split(0)})
    tokens = gt.to_global(torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1)), p, gt.split(0))
    plan, runs = gt.step_plan(), []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with plan:
            with gt.comm_log() as log:
                out = model(tokens)
                out.sum().backward()
        runs.append((log.recv_bytes, out.full_tensor().detach(),
                     {k: v.grad.full_tensor() for k, v in model.named_parameters()}, plan.steering))
    return runs


@requires_experts
@pytest.mark.parametrize("n", [2, 4])
def test_torch_test_transformer_experts_steered_is_dtensor_expert_parallel(transformer_reference, n):
    """Under a step plan the same model moves exactly DTensor's ExpertParallel pattern: per MoE layer
    the tokens all-gathered before the experts and the summed expert outputs reduce-scattered back
    (forward), the duals backward: 4 collectives of the [B, T, d] tokens' (n-1)/n, each
    (n-1)/n x 4 x 8 x 16 x 8 bytes, 2 layers: 16,384 bytes per rank at n = 2, 24,576 at n = 4.
    Op by op: 34,816 and 35,520 (the expand all-to-alls the expanded tensor, see above). Equal to one
    device in both runs."""
    want_out, want_grads, *_ = transformer_reference
    tokens_bytes = 4 * 8 * 16 * 8
    textbook = 2 * 4 * (n - 1) * tokens_bytes // n
    for r, runs in enumerate(_launch(_torch_transformer_steered, n, n)):
        for _, out, grads, _ in runs:
            torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
            for k, g in grads.items():
                torch.testing.assert_close(g, want_grads[k], rtol=1e-10, atol=1e-12, msg=k)
        steered_bytes, *_, steered = runs[1]
        assert steered, f"rank {r}: the second run left the plan"
        assert steered_bytes == textbook, f"rank {r}: {steered_bytes} bytes, ExpertParallel's is {textbook}"


# -- the model, trained --------------------------------------------------------------------------------

STEPS = 3
SMALL = MoEConfig(**{**CFG.__dict__, "n_layer": 1, "n_embd": 8, "expert_hidden": 16, "vocab_size": 16})


def small(k: int, dropless: bool = False) -> MoEConfig:
    """The 20-step runs' model: one block, d = 8 (the property is per step and per layer, not size)."""
    return MoEConfig(**{**SMALL.__dict__, "top_k": k, "dropless": dropless})


def _batch(cfg: MoEConfig = CFG):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=g),
            torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=g))


def train(mesh=None, expert_axis=0, steps=STEPS, tensor_axis=None, zero=False, cfg=CFG):
    """AdamW steps of a MoEGPT of `cfg` (capacity or dropless), on one device or placed by moe_gpt_plan."""
    torch.manual_seed(0)
    model = MoEGPT(cfg).double()
    idx, tgt = _batch(cfg)
    if mesh is not None:
        p = gt.placement("cpu", np.arange(int(np.prod(mesh))).reshape(mesh).tolist())
        gt.to_global(model, p, moe_gpt_plan(expert_axis, len(mesh), tensor_axis, zero=zero, dropless=cfg.dropless))
        batch = ep_batch(len(mesh), tensor_axis)
        idx, tgt = gt.to_global(idx, p, batch), gt.to_global(tgt, p, batch)
    return adamw_steps(model, idx, tgt, steps, "last_choice" if cfg.dropless else "last_kept", mesh is not None)


def adamw_steps(model: MoEGPT, idx, tgt, steps: int, decisions: str, placed: bool) -> tuple:
    """AdamW steps: each step's loss, the MoE layers' routing decisions (attribute `decisions`) and
    collectives forward and backward, then the parameters, and what the token embedding's backward
    moves alone (`embedding_backward_events`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    whole = (lambda t: t.full_tensor()) if placed else (lambda t: t)  # noqa: E731
    losses, routing, logs = [], [], []
    embedding = embedding_backward_events(model.wte, idx) if placed else []
    for _ in range(steps):
        with gt.comm_log() as fwd:
            _, loss = model(idx, tgt)
        opt.zero_grad()
        with gt.comm_log() as bwd:
            loss.backward()
        opt.step()
        logs.append(([(e.kind, e.recv_bytes) for e in fwd.events], [(e.kind, e.recv_bytes) for e in bwd.events]))
        losses.append(whole(loss).item())
        routing.append([whole(getattr(b.moe, decisions)) for b in model.blocks])
    params = {n: whole(q).detach() for n, q in model.named_parameters()}
    return losses, routing, params, logs, embedding


def assert_same_training(losses: list, routing: list, params: dict, want_losses: list, want_routing: list,
                         want_params: dict) -> None:
    """Losses and parameters equal to fp64 1e-10, every step's routing decisions exactly."""
    np.testing.assert_allclose(losses, want_losses, **TOL)
    for got, ref in zip(routing, want_routing):
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    for name, q in params.items():
        torch.testing.assert_close(q, want_params[name], **TOL, msg=name)


def embedding_backward_events(wte: torch.nn.Embedding, idx: torch.Tensor) -> list:
    """What the token embedding's backward moves alone, on the model's layouts (not the MoE's: with
    few tokens per rank the cost model prefers moving the [B, T, d] gradient over reducing [V, d])."""
    grad = torch.zeros(*idx.shape, wte.embedding_dim, dtype=wte.weight.dtype)
    grad = gt.to_global(grad, idx.placement, idx.sbp)
    with gt.comm_log() as log:
        g, = torch.autograd.grad(F.embedding(idx, wte.weight), wte.weight, grad)
    return [(e.kind, e.recv_bytes) for e in log.events]


@pytest.fixture(scope="module")
def reference():
    return train()


@pytest.fixture(scope="module")
def capacity_reference():
    """One device, 20 AdamW steps of the small capacity model, top-1 and top-2: shared by every mesh."""
    return {k: train(steps=20, cfg=small(k)) for k in (1, 2)}


@pytest.mark.parametrize("mesh, expert_axis", [((4,), 0), ((2, 2), 1)])
@pytest.mark.parametrize("k", [1, 2])
def test_model_adamw_20_steps_equals_one_device(capacity_reference, mesh, expert_axis, k):
    """20 AdamW steps of the capacity MoEGPT on EP=4 and EP=2 x DP=2, top-1 and top-2: losses, every
    step's routing decisions (which choices were dropped: the reference drops some) and the parameters
    equal one device, nothing falls back; every step moves exactly the two ideal all-to-alls per layer
    each way (check_model_bytes)."""
    want_losses, want_kept, want_params, *_ = capacity_reference[k]
    assert any((kept == 0).any() for step in want_kept for kept in step), "no token dropped: routing untested"
    before = dict(gt.stats()["fallback"])
    n = int(np.prod(mesh))
    results = _launch(train, n, mesh, expert_axis, 20, None, False, small(k))
    assert dict(gt.stats()["fallback"]) == before
    for rank, (losses, kept, params, logs, embedding) in enumerate(results):
        assert_same_training(losses, kept, params, want_losses, want_kept, want_params)
        check_model_bytes(mesh, expert_axis, rank, logs, embedding, small(k))


def check_model_bytes(mesh: tuple, expert_axis: int, rank: int, logs: list, embedding: list, cfg: MoEConfig) -> None:
    """Forward and backward of the whole model: only the MoE all-to-alls move data (the loss and the
    gradients stay Partial until read: the optimizer's reductions are data parallelism's), besides
    cross_entropy's scalar over a split batch (reduced axis by axis on a 2-D mesh: collectives of at
    most one fp64 per peer) and what the token embedding's backward moves alone (measured on its own)."""
    n, m = int(np.prod(mesh)), mesh[expert_axis]
    want = ideal_all_to_all(cfg, BATCH // (n // m), cfg.block_size, m)[rank % m]
    per_layer = [("all_to_all", b) for b in want]
    for fwd, bwd in logs:
        assert [e for e in fwd if e[0] == "all_to_all"] == per_layer * cfg.n_layer, (rank, fwd)
        assert all(b <= 8 * n for k, b in fwd if k != "all_to_all"), (rank, fwd)
        assert bwd == per_layer * cfg.n_layer + embedding, (rank, bwd, embedding)


@pytest.mark.parametrize("k", [1, 2])
def test_model_ep_x_tp_adamw_20_steps_equals_one_device(capacity_reference, k):
    """20 AdamW steps on EP=2 x TP=2: experts split on E (axis 0) and Megatron-style on their hidden dim
    (axis 1), attention and the tied embedding tensor-parallel: losses, every step's routing decisions
    and the parameters equal one device, nothing falls back; each step's all-to-alls are the layer's
    (test_layer_ep_x_tp_2x2): the dispatch whole, the combine of half the tensor forward."""
    want_losses, want_kept, want_params, *_ = capacity_reference[k]
    cfg = small(k)
    before = dict(gt.stats()["fallback"])
    results = _launch(train, 4, (2, 2), 0, 20, 1, False, cfg)
    assert dict(gt.stats()["fallback"]) == before
    dispatch, combine = ideal_all_to_all(cfg, BATCH, cfg.block_size, 2)[0]
    for rank, (losses, kept, params, logs, _) in enumerate(results):
        assert_same_training(losses, kept, params, want_losses, want_kept, want_params)
        for fwd, bwd in logs:
            assert [e for e in fwd if e[0] == "all_to_all"] == [("all_to_all", dispatch),
                                                               ("all_to_all", combine // 2)], (rank, fwd)


@pytest.mark.parametrize("mesh, expert_axis", [((2,), 0), ((4,), 0), ((2, 2), 1)])
def test_model_ep_with_zero3(reference, mesh, expert_axis):
    """EP with ZeRO-3 on the same axis (dense parameters stored S(0), gathered per block; experts used
    where they are stored): equal to one device after AdamW steps, the MoE all-to-alls unchanged, and
    no all-gather as large as a layer's experts (they are never gathered)."""
    want_losses, want_kept, want_params, *_ = reference
    before = dict(gt.stats()["fallback"])
    n = int(np.prod(mesh))
    results = _launch(train, n, mesh, expert_axis, STEPS, None, True)
    assert dict(gt.stats()["fallback"]) == before
    m = mesh[expert_axis]
    want = ideal_all_to_all(CFG, BATCH // (n // m), CFG.block_size, m)
    experts_bytes = sum(q.numel() for q in MoE(CFG).experts.parameters()) * 8 // m
    for rank, (losses, kept, params, logs, _) in enumerate(results):
        assert_same_training(losses, kept, params, want_losses, want_kept, want_params)
        for fwd, bwd in logs:
            assert [e for e in fwd if e[0] == "all_to_all"] == [("all_to_all", b) for b in want[rank % m]] * 2
            assert all(b < experts_bytes for k, b in fwd + bwd if k == "all_gather"), (fwd, bwd)


# -- dropless: ragged rows per expert ------------------------------------------------------------------

def _dropless(cfg: MoEConfig, **kw) -> MoEConfig:
    return MoEConfig(**{**cfg.__dict__, "dropless": True, **kw})


def _owners(groups: int, mesh: tuple, unit: int = 1) -> list[tuple]:
    """The mesh coordinate holding each group when every mesh axis splits the groups (axis 0 first), in
    whole units of `unit` (a sequence's groups, see _cut)."""
    owners = []
    for g in range(groups):
        g //= unit
        lo, length, coord = 0, groups // unit, []
        for m in mesh:
            for i, size in enumerate(_split_sizes(length, m)):
                if lo <= g < lo + size:
                    coord.append(i)
                    length = size
                    break
                lo += size
        owners.append(tuple(coord))
    return owners


def dropless_bytes(cfg: MoEConfig, choice: torch.Tensor, mesh: tuple, expert_axis: int, coord: tuple) -> tuple:
    """What the rank at `coord` receives in one dropless layer, from the one-device routing `choice`
    [G, S, k]: the count all-gather ([G_r, E] int64 of each other member of its expert group), the
    dispatch (the routed rows of its experts from other members' tokens) and the combine (its tokens'
    rows computed by other members' experts); the backward receives the dispatch's and the combine's again."""
    groups, e, d = choice.shape[0], cfg.n_expert, cfg.n_embd
    owners = _owners(groups, mesh, per_sequence(cfg))
    expert_rank = [i for i, n in enumerate(_split_sizes(e, mesh[expert_axis])) for _ in range(n)]
    same_slice = lambda o: all(o[a] == coord[a] for a in range(len(mesh)) if a != expert_axis)  # noqa: E731
    me = coord[expert_axis]
    counts = sum(1 for o in owners if same_slice(o) and o != coord) * e * 8
    dispatch = combine = 0
    for g in range(groups):
        if not same_slice(owners[g]):
            continue
        for ex in choice[g].reshape(-1).tolist():
            mine, here = expert_rank[ex] == me, owners[g] == coord
            dispatch += mine and not here
            combine += here and not mine
    return counts, dispatch * d * 8, combine * d * 8


def _dropless_layer_step(cfg, batch, seed, skew, mesh, expert_axis):
    layer, x, w = _layer_inputs(cfg, batch, seed, skew)
    p = gt.placement("cpu", np.arange(int(np.prod(mesh))).reshape(mesh).tolist())
    gt.to_global(layer, p, ep_plan(expert_axis, len(mesh), dropless=True))
    x = gt.to_global(x, p, ep_batch(len(mesh))).requires_grad_(True)
    w = gt.to_global(w, p, ep_batch(len(mesh)))
    with gt.comm_log() as fwd:
        y, aux = layer(x)
    with gt.comm_log() as bwd:
        ((y * w).sum() + aux).backward()
    grads = {k: v.grad.full_tensor() for k, v in layer.named_parameters()}
    return ([(e.kind, e.recv_bytes) for e in fwd.events], [(e.kind, e.recv_bytes) for e in bwd.events],
            y.full_tensor(), aux.full_tensor(), layer.last_choice.full_tensor(), x.grad.full_tensor(), grads)


def check_dropless_layer(cfg: MoEConfig, batch: int, mesh: tuple, expert_axis: int = 0, seed: int = 0,
                         skew=False) -> None:
    """Values and routing equal one device, nothing falls back; forward: the count exchange and two
    all-to-alls of exactly the routed rows, backward the same two, nothing else."""
    before = dict(gt.stats()["fallback"])
    n = int(np.prod(mesh))
    results = _launch(_dropless_layer_step, n, cfg, batch, seed, skew, mesh, expert_axis)
    assert dict(gt.stats()["fallback"]) == before
    layer, x, w = _layer_inputs(cfg, batch, seed, skew)
    x.requires_grad_(True)
    y_ref, aux_ref = layer(x)
    ((y_ref * w).sum() + aux_ref).backward()
    choice = layer.last_choice
    for rank, (fwd, bwd, y, aux, got_choice, xg, grads) in enumerate(results):
        torch.testing.assert_close(y, y_ref.detach(), **TOL)
        torch.testing.assert_close(aux, aux_ref.detach(), **TOL)
        assert torch.equal(got_choice, choice)
        torch.testing.assert_close(xg, x.grad, **TOL)
        for k, v in layer.named_parameters():
            torch.testing.assert_close(grads[k], v.grad, **TOL, msg=k)
        coord = tuple(np.argwhere(np.arange(n).reshape(mesh) == rank)[0])
        counts, dispatch, combine = dropless_bytes(cfg, choice, mesh, expert_axis, coord)
        if mesh[expert_axis] == 1:
            continue
        ours = [("all_gather", counts), ("all_to_all", dispatch), ("all_to_all", combine)]
        assert ours in (fwd, without_aux_gather(fwd, choice.shape[0], mesh, coord, per_sequence(cfg))), (rank, fwd)
        assert bwd == ours[1:], (rank, bwd)


@pytest.mark.parametrize("mesh, expert_axis", [((2,), 0), ((4,), 0), ((2, 2), 1)])
@pytest.mark.parametrize("k", [1, 2])
def test_dropless_layer_equals_one_device_at_routed_bytes(mesh, expert_axis, k):
    check_dropless_layer(_dropless(CFG, top_k=k), BATCH, mesh, expert_axis)


@settings(max_examples=max(10, settings.default.max_examples * 5 // 9), deadline=None)   # 10 in CI
@given(k=st.sampled_from([1, 2]), experts=st.integers(1, 6), mesh=st.sampled_from(MESHES), batch=st.integers(1, 6),
       group=st.sampled_from([None, 4]), skew=st.sampled_from(SKEWS), seed=st.integers(0, 3))
@example(k=2, experts=4, mesh=((2,), 0), batch=3, group=4, skew=False, seed=0)           # G ragged: 4+2 groups
@example(k=1, experts=3, mesh=((2, 2), 1), batch=5, group=4, skew="equal", seed=2)      # nested runs on 2x2
@example(k=2, experts=4, mesh=((2, 2), 0), batch=6, group=4, skew=False, seed=1)         # the expert axis first
@example(k=2, experts=5, mesh=((2, 2), 0), batch=1, group=None, skew=False, seed=0)      # a single group
def test_dropless_layer_hypothesis(k, experts, mesh, batch, group, skew, seed):
    """Group counts that do not divide over the ranks (ranks with one group, or none), E below or not a
    multiple of the expert axis (uneven or empty expert shards), EP on 1-D meshes and EP x DP on 2x2 (the
    expert axis last or first), every token to the same k experts ("equal", the others get no rows) or
    every token to one expert with another empty under top-1 and top-2 ("hot"): values and routing equal
    one device, bytes exactly the routed rows' (the whole layer). Groups smaller than a sequence with a
    batch that does not divide included: [B, T, d] -> [G, S, d] leaves G ragged, in units of a sequence's
    groups, which the router's ops keep and by_expert / by_group take as they are (dropless_bytes of that
    cut; with the expert axis first on 2x2 its peers hold runs of different outer pieces, whose sizes
    follow from the unit). A single group (batch 1) too, as in test_layer_hypothesis."""
    mesh, expert_axis = mesh
    cfg = _dropless(CFG, top_k=min(k, experts), n_expert=experts, group_size=group)
    check_dropless_layer(cfg, batch, mesh, expert_axis, seed=seed, skew=skew)


def train_dropless(mesh=None, expert_axis=0, steps=20, k=2, zero=False, tensor_axis=None):
    """`train` for the small dropless MoEGPT: losses, routing, parameters, each step's collectives, and its config."""
    cfg = small(k, dropless=True)
    return train(mesh, expert_axis, steps, tensor_axis, zero, cfg) + (cfg,)


@pytest.fixture(scope="module")
def dropless_reference():
    return {k: train_dropless(k=k) for k in (1, 2)}


@pytest.mark.parametrize("mesh, expert_axis", [((4,), 0), ((2, 2), 1)])
@pytest.mark.parametrize("k", [1, 2])
def test_dropless_model_adamw_20_steps_equals_one_device(dropless_reference, mesh, expert_axis, k):
    """20 AdamW steps of a dropless MoEGPT on EP=4 and EP=2 x DP=2: losses, every step's routing and the
    parameters equal one device; each step's MoE collectives are the count exchange and the two
    all-to-alls of exactly the routed rows forward, the same two backward (besides what the token
    embedding's backward moves alone, as in check_model_bytes)."""
    want_losses, want_choices, want_params, _, _, cfg = dropless_reference[k]
    before = dict(gt.stats()["fallback"])
    n = int(np.prod(mesh))
    results = _launch(train_dropless, n, mesh, expert_axis, 20, k)
    assert dict(gt.stats()["fallback"]) == before
    for rank, (losses, choices, params, logs, embedding, _) in enumerate(results):
        assert_same_training(losses, choices, params, want_losses, want_choices, want_params)
        coord = tuple(np.argwhere(np.arange(n).reshape(mesh) == rank)[0])
        for (fwd, bwd), step_choices in zip(logs, want_choices):
            want_fwd, want_bwd = [], []
            for choice in step_choices:
                counts, dispatch, combine = dropless_bytes(cfg, choice, mesh, expert_axis, coord)
                want_fwd += [("all_gather", counts), ("all_to_all", dispatch), ("all_to_all", combine)]
                want_bwd += [("all_to_all", dispatch), ("all_to_all", combine)]
            assert fwd[:len(want_fwd)] == want_fwd, (rank, fwd, want_fwd)
            rest = fwd[len(want_fwd):]   # the loss's scalar (cross_entropy over a split batch, reduced axis by axis)
            assert all(kind != "all_to_all" and b <= 8 * n for kind, b in rest), (rank, fwd)
            assert bwd == want_bwd + embedding, (rank, bwd, want_bwd, embedding)


def test_dropless_plan_with_tensor_axis_on_the_expert_axis_is_named():
    with pytest.raises(ValueError, match="tensor_axis"):
        ep_plan(0, 2, tensor_axis=0, dropless=True)


def tp_rows_bytes(cfg: MoEConfig, choice: torch.Tensor, expert_rank: int, ranks: int) -> int:
    """The rows the experts of `expert_rank` hold (every group's choices of them), in bytes: what one
    all-reduce of them on a 2-rank tensor axis receives."""
    mine = [e for e, r in enumerate(i for i, n in enumerate(_split_sizes(cfg.n_expert, ranks)) for _ in range(n))
            if r == expert_rank]
    return int(sum((choice == e).sum() for e in mine)) * cfg.n_embd * 8


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_layer_ep_x_tp_2x2(k):
    """EP=2 (axis 0) x TP=2 (axis 1: each expert's hidden dim split, w1/b1 column-parallel, w2 row-
    parallel): values and routing equal one device; forward the count exchange, the dispatch of exactly
    the routed rows, one all-reduce of the expert rows' Partial products on the tensor axis (Megatron's),
    the combine; backward the combine's dual, one all-reduce of the first layer's input gradient, the
    dispatch's dual. Besides those, only the router's backward moves a few hundred bytes on the tensor
    axis (the dispatcher's own choices for the replicated router, as in the capacity EP x TP layer)."""
    cfg = _dropless(CFG, top_k=k)
    before = dict(gt.stats()["fallback"])
    results = _launch(_layer_step_tp, 4, cfg, BATCH)
    assert dict(gt.stats()["fallback"]) == before
    layer, x, w = _layer_inputs(cfg, BATCH, 0, False)
    x.requires_grad_(True)
    y_ref, aux_ref = layer(x)
    ((y_ref * w).sum() + aux_ref).backward()
    choice = layer.last_choice
    probs = BATCH * cfg.block_size * cfg.n_expert * 8
    for rank, (fwd, bwd, y, xg, grads, got_choice) in enumerate(results):
        torch.testing.assert_close(y, y_ref.detach(), **TOL)
        torch.testing.assert_close(xg, x.grad, **TOL)
        assert torch.equal(got_choice, choice)
        for name, v in layer.named_parameters():
            torch.testing.assert_close(grads[name], v.grad, **TOL, msg=name)
        counts, dispatch, combine = dropless_bytes(cfg, choice, (2,), 0, (rank // 2,))
        rows = tp_rows_bytes(cfg, choice, rank // 2, 2)
        assert fwd == [("all_gather", counts), ("all_to_all", dispatch), ("all_reduce", rows),
                       ("all_to_all", combine)], (rank, fwd)
        moe = [("all_to_all", dispatch), ("all_reduce", rows), ("all_to_all", combine)]
        assert bwd[:3] == moe, (rank, bwd)
        assert all(b <= probs for _, b in bwd[3:]), (rank, bwd)


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_model_ep_x_tp_adamw_20_steps_equals_one_device(dropless_reference, k):
    """20 AdamW steps of a dropless MoEGPT on EP=2 x TP=2 (experts split on E and Megatron-style on their
    hidden dim, attention and the tied embedding tensor-parallel): losses, every step's routing and the
    parameters equal one device, nothing falls back; each step's all-to-alls are exactly the routed rows'
    (dispatch and combine forward, their duals backward), and the expert rows' all-reduces on the tensor
    axis are one forward and one backward per layer, of exactly the rows the rank's experts hold."""
    want_losses, want_choices, want_params, _, _, cfg = dropless_reference[k]
    before = dict(gt.stats()["fallback"])
    results = _launch(train_dropless, 4, (2, 2), 0, 20, k, False, 1)
    assert dict(gt.stats()["fallback"]) == before
    for rank, (losses, choices, params, logs, _, _) in enumerate(results):
        assert_same_training(losses, choices, params, want_losses, want_choices, want_params)
        for (fwd, bwd), step_choices in zip(logs, want_choices):
            want_a2a, rows = [], []
            for choice in step_choices:
                _, dispatch, combine = dropless_bytes(cfg, choice, (2,), 0, (rank // 2,))
                want_a2a += [("all_to_all", dispatch), ("all_to_all", combine)]
                rows.append(("all_reduce", tp_rows_bytes(cfg, choice, rank // 2, 2)))
            assert [e for e in fwd if e[0] == "all_to_all"] == want_a2a, (rank, fwd)
            assert all(r in fwd and r in bwd for r in rows), (rank, fwd, bwd, rows)


def _under_gloo(steps: int, k: int, layer_cfg: MoEConfig) -> tuple:
    """Both gloo checks in one launch of 4 processes (each launch costs 5-18 s of process start): the
    capacity model's AdamW steps, then one dropless layer step."""
    return (train((4,), 0, steps, None, False, small(k)),
            _dropless_layer_step(layer_cfg, BATCH, 0, False, (4,), 0))


@pytest.mark.gloo
@pytest.mark.slow  # ~30 s: 4 gloo processes; the simulator's EP tests count the same bytes
def test_ep4_under_gloo_processes(capacity_reference):
    """EP=4 through torch.distributed (gloo), not the simulator: 20 AdamW steps of the capacity model
    equal one device (losses, routing, parameters) at the ideal all-to-alls; and a dropless layer's
    count all-gather and uneven all-to-alls equal one device at exactly the routed rows."""
    cfg = _dropless(CFG, top_k=2)
    layer, x, w = _layer_inputs(cfg, BATCH, 0, False)
    x.requires_grad_(True)
    y_ref, aux_ref = layer(x)
    ((y_ref * w).sum() + aux_ref).backward()
    want_losses, want_kept, want_params, *_ = capacity_reference[2]
    results = _launch(_under_gloo, 4, 20, 2, cfg, backend="gloo")
    for rank, (model, (fwd, bwd, y, aux, choice, xg, grads)) in enumerate(results):
        losses, kept, params, logs, embedding = model
        assert_same_training(losses, kept, params, want_losses, want_kept, want_params)
        check_model_bytes((4,), 0, rank, logs, embedding, small(2))
        torch.testing.assert_close(y, y_ref.detach(), **TOL)
        torch.testing.assert_close(xg, x.grad, **TOL)
        for k, v in layer.named_parameters():
            torch.testing.assert_close(grads[k], v.grad, **TOL, msg=k)
        counts, dispatch, combine = dropless_bytes(cfg, layer.last_choice, (4,), 0, (rank,))
        assert fwd == [("all_gather", counts), ("all_to_all", dispatch), ("all_to_all", combine)], (rank, fwd)
        assert bwd == [("all_to_all", dispatch), ("all_to_all", combine)], (rank, bwd)


@pytest.mark.parametrize("mesh, expert_axis", [((2,), 0), ((2, 2), 1)])
def test_dropless_model_with_zero3(dropless_reference, mesh, expert_axis):
    """Dropless EP with ZeRO-3 on the expert axis (dense parameters stored S(0), gathered per block; the
    experts used where they are stored): losses and routing equal one device over 3 AdamW steps."""
    want_losses, want_choices, want_params, *_ = dropless_reference[2]
    results = _launch(train_dropless, int(np.prod(mesh)), mesh, expert_axis, 3, 2, True)
    for losses, choices, params, *_ in results:
        np.testing.assert_allclose(losses, want_losses[:3], **TOL)
        for got, ref in zip(choices, want_choices):
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
