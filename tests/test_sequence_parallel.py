"""Sequence parallelism by plan alone: Megatron-SP (`sp_plan`) and DeepSpeed-Ulysses (`ulysses_plan`) on GPT.

Training (20 AdamW steps, fp64) equals one device; the bytes of a step equal the papers' counts,
worked out from the model's dims (per rank, fp64, data degree d, the sequence axis' size n or t):

- Megatron-SP: `tp_plan`'s communication with every activation all-reduce of TP turned into a
  reduce-scatter and an all-gather of the same bytes: per layer forward an all-gather into and a
  reduce-scatter out of attention and of the MLP, the same backward (their duals); one reduce-scatter
  where the embedding sum is split (`drop`), one all-gather into the head. The vocab-parallel loss and
  the data axis' gradient bucket are `tp_plan`'s (tests/test_gpt_comm.py). The norm weights' gradients
  are Partial over the sequence split too: one bucket for all of them, reduced as the planner does
  Partial on two axes (reduce-scatter over data, all-reduce over the sequence, all-gather over data).
- Ulysses: per layer 4 all-to-alls forward (q, k, v to the heads split, the output back) and their 4
  duals backward, (n-1)/n^2 of one activation each; the position embedding's gradient all-gathered
  once; every other gradient Partial over both axes, reduced in the bucket. The same whether the plan
  converts q, k, v at their linears or the attention's rule does (`heads_at_linears=False` under
  `gt.attention_method("ulysses")`): nothing is converted twice.
"""
from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, seq_batch, sp_plan, ulysses_plan
from training import adamw_steps

CFG = GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_embd=16)
STEPS = 20
F64 = 8


def _placement(mesh: tuple) -> gt.Placement:
    return gt.placement("cpu", np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())


METHOD = {"sp": "auto", "ulysses": "auto", "ulysses-dispatch": "ulysses", "ring": "ring"}


def _setup(kind: str, mesh: tuple | None, batch: int):
    """(model, idx, tgt, placement) for `kind`: data axis 0, sequence axis 1. "ulysses-dispatch" and "ring" take
    q, k, v split on the sequence into attention (`heads_at_linears=False`) under `gt.attention_method`."""
    torch.manual_seed(0)
    model = GPT(CFG).double()
    g = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, CFG.vocab_size, (batch, CFG.block_size), generator=g) for _ in range(2))
    if mesh is None:
        return model, idx, tgt, None
    p = _placement(mesh)
    if kind == "sp":
        gt.to_global(model, p, sp_plan(1, 2))
        sbp = dp_batch(0, 2)
    else:
        gt.to_global(model, p, ulysses_plan(1, 2, heads_at_linears=kind == "ulysses"))
        sbp = seq_batch(1, 2, data_axis=0)
    return model, gt.to_global(idx, p, sbp), gt.to_global(tgt, p, sbp), p


def train(kind: str, mesh: tuple | None, batch: int, steps: int = STEPS):
    with gt.attention_method(METHOD[kind]):  # kept through the backward, which decides its kernel then
        return _train(kind, mesh, batch, steps)


def _train(kind: str, mesh: tuple | None, batch: int, steps: int):
    model, idx, tgt, p = _setup(kind, mesh, batch)
    return adamw_steps(model, idx, tgt, steps, p is not None)


def _batch(kind: str, mesh: tuple) -> int:
    """Megatron-SP takes any batch; Ulysses one sequence per data rank (see `ulysses_plan`)."""
    return 4 if kind == "sp" else mesh[0]


def _assert_same(got, want, atol=1e-10):
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=atol)
    for name, p in got[1].items():
        if name.endswith("attn.k.bias"):
            # softmax is shift-invariant per query, so this gradient is exactly 0 in exact arithmetic;
            # AdamW divides its rounding noise by its own size, so the noise decides the update
            continue
        torch.testing.assert_close(p, want[1][name], rtol=0, atol=atol, msg=name)


CASES = [("sp", (1, 2)), ("sp", (2, 2)), ("ulysses", (1, 2)), ("ulysses", (2, 2)), ("ulysses-dispatch", (2, 2))]


@pytest.mark.parametrize("kind,mesh", CASES + [("ring", (1, 2)), ("ring", (2, 2))])
def test_training_equals_one_device(kind, mesh):
    batch = _batch(kind, mesh)
    want = train(kind, None, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(train, mesh[0] * mesh[1], args=(kind, mesh, batch))
    for got in results:
        _assert_same(got, want)
    assert gt.stats()["fallback"] == {}


# -- bytes per step ---------------------------------------------------------------------------
def _norm_numel() -> int:
    return (2 * CFG.n_layer + 1) * 2 * CFG.n_embd


def megatron_sp(mesh: tuple, params: list) -> Counter:
    """{(phase, kind, mesh axis, "n" | "b"): count | bytes one rank receives}; params: (shape, tp-split?, norm?)."""
    d, t = mesh
    n_tok, h, out = _batch("sp", mesh) // d * CFG.block_size, CFG.n_embd, Counter()
    act = n_tok * h * F64  # one activation of this data rank, whole

    def add(phase, kind, axis, nbytes):
        out[(phase, kind, axis, "n")] += 1
        out[(phase, kind, axis, "b")] += nbytes

    scatter = gather = (t - 1) * act // t
    add("forward", "reduce_scatter", 1, scatter)              # the embedding sum split (`drop`)
    add("backward", "all_gather", 1, gather)                  #   its gradient
    for _ in range(CFG.n_layer):
        for _region in ("attn", "mlp"):
            add("forward", "all_gather", 1, gather)           # into the column-parallel linears
            add("forward", "reduce_scatter", 1, scatter)      # out of the row-parallel one
            add("backward", "all_gather", 1, gather)          # the output's gradient
            add("backward", "reduce_scatter", 1, scatter)     # the input's gradient
    add("forward", "all_gather", 1, gather)                   # into the vocab-parallel head
    add("backward", "reduce_scatter", 1, scatter)             #   its input's gradient
    for phase in ("forward", "forward", "backward"):          # log_softmax over the split vocab (row max,
        add(phase, "all_reduce", 1, 2 * (t - 1) * n_tok * F64 // t)  # row sum; backward: row sum)
    if d > 1:
        add("forward", "all_reduce", 0, 2 * (d - 1) * F64 // d)  # the mean's count of targets
        add("step", "all_reduce", 0, sum(2 * (d - 1) * int(np.prod(s)) * F64 // (t if split else 1) // d
                                         for s, split, norm in params if not norm))
    norms = _norm_numel() * F64
    if d > 1:                                                 # norm gradients: Partial on both axes
        add("step", "reduce_scatter", 0, (d - 1) * norms // d)
        add("step", "all_reduce", 1, 2 * (t - 1) * (norms // d) // t)
        add("step", "all_gather", 0, (d - 1) * norms // d)
    else:
        add("step", "all_reduce", 1, 2 * (t - 1) * norms // t)
    return out


def ulysses(mesh: tuple, params: list) -> Counter:
    d, n = mesh
    h, out = CFG.n_embd, Counter()
    act = _batch("ulysses", mesh) // d * CFG.block_size * h * F64

    def add(phase, kind, axis, nbytes):
        out[(phase, kind, axis, "n")] += 1
        out[(phase, kind, axis, "b")] += nbytes

    for _ in range(CFG.n_layer):
        for phase in ("forward", "backward"):
            for _tensor in ("q", "k", "v", "out"):
                add(phase, "all_to_all", 1, (n - 1) * act // n ** 2)
    wpe = CFG.block_size * h * F64
    add("backward", "all_gather", 1, (n - 1) * wpe // n)  # position embedding: its slice's gradient gathered
    if d > 1:
        add("backward", "all_reduce", 0, 2 * (d - 1) * (wpe // n) // d)  # and its slice summed over the batch
    for axis, size in ((0, d), (1, n)):  # the mean's count of targets: a scalar on each split axis
        if size > 1:
            add("forward", "all_reduce", axis, 2 * (size - 1) * F64 // size)
    grads = sum(int(np.prod(s)) for s, _, _ in params) - CFG.block_size * h  # all but the position embedding
    if d > 1:
        add("step", "reduce_scatter", 0, (d - 1) * grads * F64 // d)
        add("step", "all_reduce", 1, 2 * (n - 1) * (grads * F64 // d) // n)
        add("step", "all_gather", 0, (d - 1) * grads * F64 // d)
    else:
        add("step", "all_reduce", 1, 2 * (n - 1) * grads * F64 // n)
    return out


def _measure(kind: str, mesh: tuple):
    with gt.attention_method(METHOD[kind]):
        return _measure_in(kind, mesh)


def _measure_in(kind: str, mesh: tuple):
    model, idx, tgt, p = _setup(kind, mesh, _batch(kind, mesh))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    axis_of = {tuple(grp): a for a in range(2) for grp in p.axis_groups(a)}
    got: Counter = Counter()
    for step in range(2):  # the second step, with every cache warm
        logs = {}
        with gt.comm_log() as logs["forward"]:
            loss = model(idx, tgt)[1]
        with gt.comm_log() as logs["backward"]:
            loss.backward()
        with gt.comm_log() as logs["step"]:
            opt.step()
            opt.zero_grad()
        if step:
            for phase, log in logs.items():
                for e in log.events:
                    got[(phase, e.kind, axis_of[tuple(e.group)], "n")] += 1
                    got[(phase, e.kind, axis_of[tuple(e.group)], "b")] += e.recv_bytes
    params = [(tuple(q.shape), q.sbp[1] != gt.broadcast, ".ln_" in "." + n) for n, q in model.named_parameters()]
    return got, params


@pytest.mark.parametrize("kind,mesh", CASES)
def test_step_bytes_equal_the_papers(kind, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(_measure, mesh[0] * mesh[1], args=(kind, mesh))
    count = megatron_sp if kind == "sp" else ulysses
    # "ulysses-dispatch": forward and backward only. The q/k/v biases' gradients are summed where the
    # attention left their inputs' gradients, split on the heads, so the optimizer gathers them (a few
    # hundred bytes) instead of reducing them in the bucket; `heads_at_linears` converts before the bias
    phases = ("forward", "backward") if kind == "ulysses-dispatch" else ("forward", "backward", "step")
    for got, params in results:
        want = {k: v for k, v in count(mesh, params).items() if v and k[0] in phases}
        assert {k: v for k, v in got.items() if k[0] in phases} == want


# -- Ulysses' backward moves each tensor once -------------------------------------------------
def _ulysses_attention():
    """q, k, v made split on the sequence (intermediates), attention chosen by cost, output back."""
    p = gt.placement("cpu", [0, 1])
    torch.manual_seed(0)
    leaves = [gt.to_global(torch.randn(1, 4, 16, 8, dtype=torch.float64), p, gt.split(2)).requires_grad_()
              for _ in range(3)]
    bytes_ = {}
    with gt.comm_log() as log:
        q, k, v = (x * 2 for x in leaves)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).to_global(p, gt.split(2))
    bytes_["forward"] = [(e.kind, e.recv_bytes) for e in log.events]
    with gt.comm_log() as log:
        (out * out).sum().backward()
        grads = [x.grad.to_global(p, gt.split(2)) for x in leaves]  # back to the sequence split
    bytes_["backward"] = [(e.kind, e.recv_bytes) for e in log.events]
    return bytes_, out.full_tensor().detach(), [g.full_tensor() for g in grads], q.sbp


def test_ulysses_backward_receives_the_textbook_bytes():
    """The dispatcher's S(seq) -> S(heads) conversion of q, k, v is kept by them (`keep_converted_inputs`), so
    the backward reads the saved tensors in the kernel's layout: 4 all-to-alls each way, none redone."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (bytes_, out, grads, qsbp), _ = gt.launch(_ulysses_attention, 2)
    a2a = ("all_to_all", (2 - 1) * 4 * 16 * 8 * F64 // 2 ** 2)
    assert bytes_ == {"forward": [a2a] * 4, "backward": [a2a] * 4}
    assert qsbp == (gt.split(1),)  # q kept the heads split the kernel used
    torch.manual_seed(0)
    leaves = [torch.randn(1, 4, 16, 8, dtype=torch.float64).requires_grad_() for _ in range(3)]
    want = F.scaled_dot_product_attention(*(x * 2 for x in leaves), is_causal=True)
    (want * want).sum().backward()
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    for g, x in zip(grads, leaves):
        torch.testing.assert_close(g, x.grad, rtol=0, atol=1e-12)


def _leaf_keeps_its_layout():
    p = gt.placement("cpu", [0, 1])
    q, k, v = (gt.to_global(torch.randn(1, 2, 8, 4), p, gt.split(2)) for _ in range(3))
    w = gt.to_global(torch.randn(1, 2, 8, 4), p, gt.split(2)).requires_grad_()
    F.scaled_dot_product_attention(q, k, w, is_causal=True)
    return q.sbp, w.sbp


def test_leaves_keep_their_layout():
    """A tensor the user laid out (no history) or a leaf requiring grad is never relaid out by an op."""
    for sbps in gt.launch(_leaf_keeps_its_layout, 2):
        assert sbps == ((gt.split(2),), (gt.split(2),))


# -- under gloo ----------------------------------------------------------------------------------
GLOO_STEPS = 2


GLOO_KINDS = ("sp", "ulysses", "ring")


def _train_each(kinds: tuple, mesh: tuple, batch: int, steps: int) -> list:
    return [train(kind, mesh, batch, steps) for kind in kinds]


@pytest.mark.gloo
def test_under_gloo_processes():
    """Megatron-SP, Ulysses and ring attention, each a GPT trained on 2 gloo processes, in one launch
    (a launch costs more than the steps)."""
    wants = [train(kind, None, 1, GLOO_STEPS) for kind in GLOO_KINDS]
    for per_rank in gt.launch(_train_each, 2, backend="gloo", args=(GLOO_KINDS, (1, 2), 1, GLOO_STEPS)):
        for got, want in zip(per_rank, wants):
            _assert_same(got, want)


# -- the linears' flattening of [batch, seq] ---------------------------------------------------
def _flatten_round_trip():
    p = _placement((2, 2))
    full = torch.arange(2 * 8 * 4, dtype=torch.float64).reshape(2, 8, 4)
    out = {}
    for sbp in [(gt.split(0), gt.split(1)), (gt.split(1), gt.split(0)), (gt.broadcast, gt.split(1)),
                (gt.split(1), gt.broadcast), (gt.split(1), gt.split(1))]:
        x = gt.to_global(full, p, sbp)
        with gt.comm_log() as log:
            flat = x.view(16, 4)
            back = (flat * 1).view(2, 8, 4)
        out[sbp] = (flat.sbp, len(log.events), torch.equal(flat.full_tensor(), full.view(16, 4)),
                    torch.equal(back.full_tensor(), full))
    return out


def test_flattening_batch_and_sequence_keeps_the_split_only_where_order_holds():
    """[b, s] split on both (one sequence per data rank) flattens with no communication; an order the
    merged dim cannot hold (the sequence cut first) is converted, never wrong."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = gt.launch(_flatten_round_trip, 4)[0]
    assert all(same and back for _, _, same, back in got.values())
    assert got[(gt.split(0), gt.split(1))][:2] == ((gt.split(0), gt.split(0)), 0)
    assert got[(gt.broadcast, gt.split(1))][:2] == ((gt.split(0), gt.split(0)), 0)  # the batch sliced first: free
    assert got[(gt.split(1), gt.split(0))][1] > 0
