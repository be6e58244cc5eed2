"""torch.compile over global programs: GlobalTensor is a traceable wrapper subclass, collectives are graph ops.

Each test compiles with `fullgraph=True` on the aot_eager backend (AOTAutograd's graphs, run by torch's eager
kernels: what inductor would be handed, without its C++ compile time) on simulated ranks, and checks

- values: equal to the same program in eager globaltensor and to plain torch on one device;
- graphs: the forward and backward graphs AOTAutograd captured hold only local aten ops and the
  `globaltensor::` collectives (`runtime/graph_ops.py`), listed and priced against the textbook bytes;
- bytes: what `gt.comm_log()` counts for a compiled run equals the graph's count and eager's;
- counters: no graph breaks (`torch._dynamo.utils.counters["graph_break"]`), and no compile on a second call.
"""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import globaltensor as gt
from globaltensor.runtime.comm import all_reduce_recv_bytes

F32 = 4


class Capture:
    """An aot_eager backend that keeps each rank's forward and backward graphs (simulated ranks are threads:
    each traces its own, see `GlobalTensor.__tensor_flatten__`)."""

    def __init__(self) -> None:
        self.graphs: dict[int, dict[str, list]] = {}
        self._lock = threading.Lock()
        # the partitioner inductor and aot_eager use (it honours the nodes ZeRO-3 marks for recomputation)
        self.backend = aot_autograd(fw_compiler=self._keep("fw"), bw_compiler=self._keep("bw"),
                                    partition_fn=min_cut_rematerialization_partition)

    def _keep(self, kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            with self._lock:
                self.graphs.setdefault(gt.rank(), {"fw": [], "bw": []})[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def compiles(self, rank: int) -> int:
        return len(self.graphs.get(rank, {}).get("fw", []))

    def collectives(self, rank: int, kind: str) -> list[tuple[str, tuple, int]]:
        """(collective, group, bytes this rank receives) for each globaltensor:: op of the rank's graphs."""
        out = []
        for gm in self.graphs[rank][kind]:
            for node in gm.graph.nodes:
                if node.op == "call_function" and str(node.target).startswith("globaltensor."):
                    out.append(_priced(node, rank))
        return out

    def aten_only(self, rank: int) -> bool:
        """Every op of the rank's graphs is a local aten op or one of ours (no subclass, no Python call)."""
        for kind in ("fw", "bw"):
            for gm in self.graphs[rank][kind]:
                for node in gm.graph.nodes:
                    if node.op == "call_function":
                        name = str(node.target)
                        if not (name.startswith("aten.") or name.startswith("globaltensor.")
                                or name == "<built-in function getitem>"):
                            return False
                    for v in [node.meta.get("val")]:
                        if isinstance(v, gt.GlobalTensor):
                            return False
        return True


def _priced(node: torch.fx.Node, rank: int) -> tuple[str, tuple, int]:
    """The textbook bytes a collective of the graph makes this rank receive (`runtime/comm.py`'s convention)."""
    name = str(node.target).split(".")[1]
    a = node.args
    if name == "all_reduce":
        t, group = a[0].meta["val"], tuple(a[1])
        return name, group, all_reduce_recv_bytes(t.numel(), t.element_size(), len(group), group.index(rank))
    if name == "all_gather":
        t, group = a[0].meta["val"], tuple(a[1])
        pieces = node.meta["val"]
        return name, group, sum(p.numel() * p.element_size() for j, p in enumerate(pieces) if group[j] != rank)
    if name == "reduce_scatter":
        chunks, group = [c.meta["val"] for c in a[0]], tuple(a[1])
        mine = chunks[group.index(rank)]
        return name, group, (len(group) - 1) * mine.numel() * mine.element_size()
    if name == "all_to_all":
        recv_splits, group = a[2], tuple(a[3])
        size = a[0].meta["val"].element_size()
        return name, group, (sum(recv_splits) - recv_splits[group.index(rank)]) * size
    raise AssertionError(name)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _full(t):
    return t.full_tensor().detach() if isinstance(t, gt.GlobalTensor) else t.detach()


def test_dp_forward_compiles_without_communication():
    """DP's forward (batch split, weights whole) needs no collective: the graph is the local program."""
    torch.manual_seed(0)
    X, W1, W2 = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 3)
    want = torch.relu(X @ W1) @ W2
    cap = Capture()

    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    def body():
        p = gt.placement("cpu", [0, 1])
        x, w1, w2 = gt.to_global(X, p, gt.split(0)), gt.to_global(W1, p, gt.broadcast), gt.to_global(W2, p, gt.broadcast)
        cf = torch.compile(f, backend=cap.backend, fullgraph=True)
        with gt.comm_log() as log:
            y = cf(x, w1, w2)
            y2 = cf(x, w1, w2)
        eager = f(x, w1, w2)
        return y.sbp, _full(y), _full(y2), _full(eager), log.recv_bytes

    for rank, (sbp, y, y2, eager, nbytes) in enumerate(gt.launch(body, 2)):
        assert sbp == (gt.split(0),)
        _close(y, want), _close(y2, want), _close(y, eager)
        assert nbytes == 0
        assert cap.collectives(rank, "fw") == []
        assert cap.aten_only(rank)
        assert cap.compiles(rank) == 1  # the second call reused the graph
    assert dict(counters["graph_break"]) == {}


def test_collectives_are_graph_ops_priced_as_textbook():
    """x S(1) @ w S(0) is Partial; relu needs it whole per row block: one reduce-scatter forward (to S(0)),
    and its dual, one all-gather of the gradient, backward (compiled; eager's backward differs: see below). Each
    rank receives (n-1)/n of the [8, 3] product forward and of its gradient backward: 4*3 floats on 2 ranks."""
    torch.manual_seed(0)
    X, W = torch.randn(8, 4), torch.randn(4, 3)
    Xr = X.clone().requires_grad_(True)
    Wr = W.clone().requires_grad_(True)
    (torch.relu(Xr @ Wr) * 2).sum().backward()
    cap = Capture()

    def f(x, w):
        return torch.relu(x @ w) * 2

    def body():
        p = gt.placement("cpu", [0, 1])
        out = {}
        for mode in ("eager", "compiled"):
            x = gt.to_global(X, p, gt.split(1))
            w = gt.to_global(W, p, gt.split(0)).requires_grad_(True)
            fn = f if mode == "eager" else torch.compile(f, backend=cap.backend, fullgraph=True)
            with gt.comm_log() as fw:
                y = fn(x, w)
            with gt.comm_log() as bw:
                y.sum().backward()
            out[mode] = (_full(y), _full(w.grad), fw.summary(), bw.summary())
        return out

    want_bytes = 4 * 3 * F32
    for rank, out in enumerate(gt.launch(body, 2)):
        (y, g, fw, bw), (ey, eg, efw, ebw) = out["compiled"], out["eager"]
        _close(y, torch.relu(X @ W) * 2), _close(g, Wr.grad), _close(y, ey), _close(g, eg)
        assert cap.collectives(rank, "fw") == [("reduce_scatter", (0, 1), want_bytes)]
        assert cap.collectives(rank, "bw") == [("all_gather", (0, 1), want_bytes)]
        assert fw == efw == {"reduce_scatter": want_bytes}  # the compiled graph's collectives are eager's
        # backward: w is a leaf whose gradient is read in w's layout, S(0); eager prices the product's output as
        # that (`ops/scope.grad_sink`) and exchanges x's rows instead, 8 floats an all-to-all; a compiled backward
        # is one node over every leaf, where the sink is not known, and gathers the gradient as the forward's dual
        assert bw == {"all_gather": want_bytes} and ebw == {"all_to_all": 8 * F32}
        assert cap.aten_only(rank)
    # each rank traced its own graph (its own chunk of the reduce-scatter): the rank is in the guarded metadata
    idx = [[n.args[3] for n in cap.graphs[r]["fw"][0].graph.nodes if "reduce_scatter" in str(n.target)]
           for r in (0, 1)]
    assert idx == [[0], [1]]
    assert dict(counters["graph_break"]) == {}


def _plain_grads(X, Ws, f):
    ws = [w.clone().requires_grad_(True) for w in Ws]
    loss = f(X, *ws)
    loss.backward()
    return loss.detach(), [w.grad for w in ws]


def test_dp_forward_backward_all_reduces_gradients_in_the_graph():
    """DP: the batch split on 2 ranks, the weights whole. A weight used as `w.to_global(grad_sbp=broadcast)`
    has its Partial gradient all-reduced in the compiled backward (the textbook 2(n-1)/n |W| per weight:
    4*6 and 6*3 floats, so 24 + 18 floats received on 2 ranks), and the loss (Partial: the sum of each
    rank's rows) needs nothing forward. Two steps: the second compiles nothing."""
    torch.manual_seed(0)
    X, W1, W2 = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 3)

    def loss_of(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).square().sum()

    want_loss, want_grads = _plain_grads(X, [W1, W2], loss_of)
    cap = Capture()

    def f(x, w1, w2):
        w1, w2 = w1.to_global(grad_sbp=gt.broadcast), w2.to_global(grad_sbp=gt.broadcast)
        return loss_of(x, w1, w2)

    def body():
        p = gt.placement("cpu", [0, 1])
        out = {}
        for mode in ("eager", "compiled"):
            x = gt.to_global(X, p, gt.split(0))
            ws = [gt.to_global(W, p, gt.broadcast).requires_grad_(True) for W in (W1, W2)]
            fn = f if mode == "eager" else torch.compile(f, backend=cap.backend, fullgraph=True)
            steps = []
            for _ in range(2):
                for w in ws:
                    w.grad = None
                with gt.comm_log() as log:
                    loss = fn(x, *ws)
                    loss.backward()
                    grads = [w.grad.sbp for w in ws]
                steps.append((_full(loss), [_full(w.grad) for w in ws], grads, log.summary()))
            out[mode] = steps
        return out

    want_bytes = all_reduce_recv_bytes(4 * 6, F32, 2, 0) + all_reduce_recv_bytes(6 * 3, F32, 2, 0)
    assert want_bytes == (24 + 18) * F32
    for rank, out in enumerate(gt.launch(body, 2)):
        for (loss, grads, sbps, log), (eloss, egrads, esbps, elog) in zip(out["compiled"], out["eager"]):
            _close(loss, want_loss), _close(loss, eloss)
            for g, eg, w in zip(grads, egrads, want_grads):
                _close(g, w), _close(g, eg)
            assert sbps == esbps == [(gt.broadcast,)] * 2
            assert log == elog == {"all_reduce": want_bytes}
        assert cap.collectives(rank, "fw") == []
        bw = cap.collectives(rank, "bw")
        assert sorted(b for _, _, b in bw) == sorted([24 * F32, 18 * F32])
        assert {k for k, _, _ in bw} == {"all_reduce"}
        assert cap.compiles(rank) == 1
        assert cap.aten_only(rank)
    assert dict(counters["graph_break"]) == {}


def test_megatron_tp_pair_compiles():
    """Megatron's MLP on 2 ranks: column-parallel w1 (split on its output), row-parallel w2 (split on its
    input). Forward: one all-reduce of the [8, 4] output (the f/g pair's g); backward: one all-reduce of the
    input's [8, 4] gradient (f's dual, asked for with grad_sbp). 2(n-1)/n * 32 floats each way."""
    torch.manual_seed(0)
    X, W1, W2 = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 4)

    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    xr = X.clone().requires_grad_(True)
    w1r, w2r = W1.clone().requires_grad_(True), W2.clone().requires_grad_(True)
    want = mlp(xr, w1r, w2r)
    want.square().sum().backward()
    cap = Capture()

    def body():
        p = gt.placement("cpu", [0, 1])

        def f(x, w1, w2):
            return mlp(x.to_global(grad_sbp=gt.broadcast), w1, w2).to_global(p, gt.broadcast)

        out = {}
        for mode in ("eager", "compiled"):
            x = gt.to_global(X, p, gt.broadcast).requires_grad_(True)
            w1 = gt.to_global(W1, p, gt.split(1)).requires_grad_(True)
            w2 = gt.to_global(W2, p, gt.split(0)).requires_grad_(True)
            fn = f if mode == "eager" else torch.compile(f, backend=cap.backend, fullgraph=True)
            with gt.comm_log() as fw:
                y = fn(x, w1, w2)
            with gt.comm_log() as bw:
                y.square().sum().backward()
            out[mode] = (_full(y), y.sbp, [_full(t.grad) for t in (x, w1, w2)], x.grad.sbp, fw.summary(),
                         bw.summary())
        return out

    each = all_reduce_recv_bytes(8 * 4, F32, 2, 0)
    for rank, out in enumerate(gt.launch(body, 2)):
        (y, sbp, grads, xsbp, fw, bw), (ey, esbp, egrads, exsbp, efw, ebw) = out["compiled"], out["eager"]
        _close(y, want.detach()), _close(y, ey)
        assert sbp == esbp == (gt.broadcast,) and xsbp == exsbp == (gt.broadcast,)
        for g, eg, w in zip(grads, egrads, (xr.grad, w1r.grad, w2r.grad)):
            _close(g, w), _close(g, eg)
        assert cap.collectives(rank, "fw") == [("all_reduce", (0, 1), each)]
        assert cap.collectives(rank, "bw") == [("all_reduce", (0, 1), each)]
        assert fw == efw == {"all_reduce": each}
        # the loss's square().sum() runs eagerly outside the compiled region: nothing else moves
        assert bw == ebw == {"all_reduce": each}
        assert cap.aten_only(rank)
    assert dict(counters["graph_break"]) == {}


GPT_PLANS = {  # name: (mesh, module plan, batch layout)
    "dp": ([0, 1], None, "dp"),
    "tp": ([[0, 1]], "tp", "dp2"),
    "sp": ([[0, 1]], "sp", "dp2"),
    "dp_x_tp": ([[0, 1], [2, 3]], "tp", "dp2"),
}


# bytes a compiled step moves beyond eager's: AOTAutograd traces the backward before any autograd node runs, so its
# choices are made without the parameters' layouts that eager's backward nodes name (`ops/scope.py`'s `grad_sink`):
# under DP the tokens' gradients are exchanged and a weight gradient left split is gathered, as eager did before
# (the MoE-GPT under EP alike: its experts' weight gradients; HF Llama under DP x TP reduces some weight gradients in
# the traced backward that eager leaves to the bucket: its step moves no more in all, split otherwise)
TRACED_WITHOUT_SINKS = {"dp": {"all_to_all": 512, "all_gather": 128}, "moe": {"all_to_all": 1024, "all_gather": 128},
                        "hf_llama": "no more"}


@pytest.mark.parametrize("plan", [p if p in ("dp", "tp") else pytest.param(p, marks=pytest.mark.slow) for p in GPT_PLANS])
def test_gpt_forward_backward_compiles_with_no_graph_break_nor_recompile(plan):
    """The GPT (models/gpt.py) on simulated ranks under DP, Megatron TP, TP + SP and DP x TP, with
    `torch.compile(fullgraph=True)` over its loss: two steps of forward + backward equal eager globaltensor and
    one device; one graph per rank (traced on the first step, reused on the second); the collectives the
    graphs hold are exactly what `gt.comm_log()` counts for the step, and what eager moves. The module plan's
    boundary hooks run at trace time (`parallel/module.py`'s `_compiled_before`). Gradients stay as eager
    leaves them (DP's Partial, reduced when the optimizer reads them, outside the graph)."""
    from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, sp_plan, tp_plan

    ranks, module_plan, batch = GPT_PLANS[plan]
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
    g = torch.Generator().manual_seed(1)
    IDX, TGT = (torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g) for _ in range(2))
    torch.manual_seed(0)
    ref = GPT(cfg)
    want_loss = ref(IDX, TGT)[1]
    want_loss.backward()
    want_grads = {n: q.grad for n, q in ref.named_parameters()}
    cap = Capture()

    def body():
        p = gt.placement("cpu", ranks)
        layout = {"dp": gt.split(0), "dp2": dp_batch(0, 2)}[batch]
        out = {}
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            model = GPT(cfg)
            gt.to_global(model, p, {None: None, "tp": tp_plan(1, 2), "sp": sp_plan(1, 2)}[module_plan])
            idx, tgt = gt.to_global(IDX, p, layout), gt.to_global(TGT, p, layout)

            def step(idx, tgt):
                return model(idx, tgt)[1]
            fn = step if mode == "eager" else torch.compile(step, backend=cap.backend, fullgraph=True)
            steps = []
            for _ in range(2):
                model.zero_grad()
                with gt.comm_log() as log:
                    loss = fn(idx, tgt)
                    loss.backward()
                steps.append((_full(loss), {n: _full(q.grad) for n, q in model.named_parameters()}, log.summary(),
                              log.recv_bytes))
            out[mode] = steps
        return out

    n = len(gt.placement("cpu", ranks).flat_ranks)
    for rank, out in enumerate(gt.launch(body, n)):
        for (loss, grads, log, nbytes), (eloss, egrads, elog, _) in zip(out["compiled"], out["eager"]):
            _close(loss, want_loss.detach()), _close(loss, eloss)
            for name, gr in grads.items():
                torch.testing.assert_close(gr, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
                torch.testing.assert_close(gr, egrads[name], rtol=1e-5, atol=1e-6, msg=name)
            extra = TRACED_WITHOUT_SINKS.get(plan, {})
            assert log == {k: elog.get(k, 0) + extra.get(k, 0) for k in elog.keys() | extra.keys()}, (log, elog)
            graph = cap.collectives(rank, "fw") + cap.collectives(rank, "bw")
            assert sum(b for _, _, b in graph) == nbytes
        assert cap.compiles(rank) == 1 and len(cap.graphs[rank]["bw"]) == 1  # step 2 compiled nothing
        assert cap.aten_only(rank)
    assert dict(counters["graph_break"]) == {}


def _gloo_programs():
    """On one gloo rank: the Megatron pair and the reduce-scatter program compiled; (graphs' collectives,
    values, comm_log bytes)."""
    graphs = []

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.append((kind, [str(n.target) for n in gm.graph.nodes
                                  if n.op == "call_function" and not str(n.target).startswith("aten.")
                                  and "getitem" not in str(n.target)]))
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    p = gt.placement("cpu", [0, 1])
    torch.manual_seed(0)
    X, W1, W2 = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 4)
    x = gt.to_global(X, p, gt.broadcast).requires_grad_(True)
    w1 = gt.to_global(W1, p, gt.split(1)).requires_grad_(True)
    w2 = gt.to_global(W2, p, gt.split(0)).requires_grad_(True)

    def pair(x, w1, w2):
        return (torch.relu(x.to_global(grad_sbp=gt.broadcast) @ w1) @ w2).to_global(p, gt.broadcast)

    with gt.comm_log() as log:
        y = torch.compile(pair, backend=backend, fullgraph=True)(x, w1, w2)
        y.square().sum().backward()
    return (graphs, _full(y), _full(x.grad), _full(w1.grad), _full(w2.grad), log.recv_bytes,
            dict(counters["graph_break"]))


@pytest.mark.gloo
def test_gloo_collectives_are_torch_functional_collectives():
    """On torch.distributed (2 gloo processes) the traced collectives are torch's own functional collectives
    (`_c10d_functional.all_reduce` + `wait_tensor`), which inductor knows how to schedule; the values equal
    the simulator's and one device's. They run on torch.distributed's process groups, not through the
    communicator, so `gt.comm_log()` counts nothing for them: the graph is where they are counted."""
    torch.manual_seed(0)
    X, W1, W2 = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 4)
    xr, w1r, w2r = (t.clone().requires_grad_(True) for t in (X, W1, W2))
    want = torch.relu(xr @ w1r) @ w2r
    want.square().sum().backward()
    pair = ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"]
    for graphs, y, gx, g1, g2, nbytes, breaks in gt.launch(_gloo_programs, 2, backend="gloo"):
        assert graphs == [("fw", pair), ("bw", pair)]
        _close(y, want.detach())
        for g, w in zip((gx, g1, g2), (xr.grad, w1r.grad, w2r.grad)):
            _close(g, w)
        assert nbytes == 0 and breaks == {}


def test_what_has_no_graph_op_raises_at_trace_time():
    """Point-to-point exchanges (pipelines, ring attention), broadcasts and the object all-gathers of
    data-dependent shapes have no graph op: met while tracing (fake shards) they raise, naming the way out,
    instead of communicating fake values or waiting for peers that are not tracing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from globaltensor.runtime import context

    def body():
        comm = context.current()
        peer = 1 - comm.rank
        with FakeTensorMode():
            t = torch.ones(2)
            with pytest.raises(RuntimeError, match="point-to-point exchange cannot be captured"):
                comm.exchange({peer: t}, {peer: ((2,), torch.float32)})
            with pytest.raises(RuntimeError, match="broadcast cannot be captured"):
                comm.broadcast(t, (0, 1), 0, (2,), torch.float32)
            with pytest.raises(RuntimeError, match="Python objects .* cannot be captured"):
                comm.all_gather_object((2,), (0, 1))
        return True

    assert all(gt.launch(body, 2))


@pytest.mark.slow
def test_issue_example_compiles_with_inductor():
    """The issue's program, `torch.relu(x @ w).sum()` with x S(1) and w S(0) on 2 simulated ranks, under the
    default backend (inductor: C++ kernels around our collective ops), forward and backward: equal to one
    device, no graph break. Slow only for inductor's C++ compile."""
    torch.manual_seed(0)
    X, W = torch.randn(8, 4), torch.randn(4, 3)
    Wr = W.clone().requires_grad_(True)
    want = torch.relu(X @ Wr).sum()
    want.backward()

    def body():
        p = gt.placement("cpu", [0, 1])
        x, w = gt.to_global(X, p, gt.split(1)), gt.to_global(W, p, gt.split(0)).requires_grad_(True)
        y = torch.compile(lambda x, w: torch.relu(x @ w).sum(), fullgraph=True)(x, w)
        y.backward()
        return _full(y), _full(w.grad)

    for y, g in gt.launch(body, 2):
        _close(y, want.detach()), _close(g, Wr.grad)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_zero_compiles_with_gathers_and_reduce_scatters_in_the_graph(stage):
    """The GPT under ZeRO-2/3 (`zero_plan`: every parameter stored S(0) on 2 ranks, gathered Broadcast per
    block and at the root) with `torch.compile(fullgraph=True)` over its loss: the gathering hooks are traced
    (`zero._traced_gather`), so the forward graph holds each group's all-gathers and the backward graph the
    reduce-scatters of their gradients. Two steps equal eager globaltensor and one device, with one graph
    per rank and no graph break.

    Bytes and collectives: eager's exactly, per phase and kind: one all-gather per group forward (its
    bucket, `boxing.execute_many`), one reduce-scatter per group backward, the loss's one-scalar all-reduce;
    ZeRO-2 keeps the gathered copies for the backward, ZeRO-3 frees them and gathers again in the backward
    (the partitioner recomputes the gather's nodes, marked for it), every parameter (n-1)/n of its bytes."""
    from globaltensor.models.gpt import GPT, GPTConfig, zero_plan

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
    g = torch.Generator().manual_seed(1)
    IDX, TGT = (torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g) for _ in range(2))
    torch.manual_seed(0)
    ref = GPT(cfg)
    want_loss = ref(IDX, TGT)[1]
    want_loss.backward()
    want_grads = {n: q.grad for n, q in ref.named_parameters()}
    psi = sum(q.numel() for q in ref.parameters())  # the tied embedding/head once
    cap = Capture()

    def body():
        p = gt.placement("cpu", [0, 1])
        out = {}
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            model = gt.to_global(GPT(cfg), p, zero_plan(0, 1, reshard_after_forward=stage == 3))
            idx, tgt = gt.to_global(IDX, p, gt.split(0)), gt.to_global(TGT, p, gt.split(0))

            def step(idx, tgt):
                return model(idx, tgt)[1]
            fn = step if mode == "eager" else torch.compile(step, backend=cap.backend, fullgraph=True)
            steps = []
            for _ in range(2):
                model.zero_grad()
                with gt.comm_log() as fw:
                    loss = fn(idx, tgt)
                with gt.comm_log() as bw:
                    loss.backward()
                steps.append((_full(loss), {n: _full(q.grad) for n, q in model.named_parameters()},
                              {n: q.grad.sbp for n, q in model.named_parameters()}, fw.summary(), bw.summary(),
                              fw.recv_bytes + bw.recv_bytes))
            out[mode] = steps
        return out

    for rank, out in enumerate(gt.launch(body, 2)):
        for (loss, grads, sbps, fw, bw, nbytes), (eloss, egrads, esbps, efw, ebw, _) in zip(out["compiled"],
                                                                                           out["eager"]):
            _close(loss, want_loss.detach()), _close(loss, eloss)
            for name, gr in grads.items():
                torch.testing.assert_close(gr, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
                torch.testing.assert_close(gr, egrads[name], rtol=1e-5, atol=1e-6, msg=name)
            assert sbps == esbps and set(sbps.values()) == {(gt.split(0),)}  # stored S(0), as their parameters
            assert fw == efw  # the all-gathers and the loss's scalar
            half = psi // 2 * F32  # (n-1)/n of the parameters on 2 ranks
            want_bw = {"reduce_scatter": half} if stage == 2 else {"all_gather": half, "reduce_scatter": half}
            assert bw == ebw == want_bw
            graph = cap.collectives(rank, "fw") + cap.collectives(rank, "bw")
            assert sum(b for _, _, b in graph) == nbytes
            groups = 1 + cfg.n_layer  # the root's and each block's
            assert sorted(k for k, _, _ in cap.collectives(rank, "fw")) == ["all_gather"] * groups + ["all_reduce"]
            assert sorted(k for k, _, _ in cap.collectives(rank, "bw")) == (
                ["all_gather"] * groups * (stage == 3) + ["reduce_scatter"] * groups)
        assert cap.compiles(rank) == 1 and len(cap.graphs[rank]["bw"]) == 1
        assert cap.aten_only(rank)
    assert dict(counters["graph_break"]) == {}


OPT_PLANS = {  # name: (mesh, module plan, batch layout)
    "dp": ([0, 1], None, "dp"),
    "tp": ([[0, 1]], "tp", "dp2"),
    "zero3": ([0, 1], "zero3", "dp"),
}


@pytest.mark.parametrize("plan", [p if p == "dp" else pytest.param(p, marks=pytest.mark.slow) for p in OPT_PLANS])
def test_adamw_step_compiles_and_trains_as_eager_and_one_device(plan):
    """A training step with its forward + backward (the loss compiled) and AdamW's step compiled
    (`torch.compile(opt.step)`) on the GPT under DP, Megatron TP and ZeRO-3, fp64, three steps: parameters
    after each step equal eager globaltensor's and one device's; the step traced once per rank: the second
    and third steps compile nothing (no recompile). Breaks only where torch.optim puts them (`_use_grad`'s
    `graph_break()`, around the update, so that AOTAutograd traces it as an inference graph) and before the
    step, where the step pre-hook reduces DP's pending gradients in their bucket (`ops/inputs.settle_step`):
    the update's graph reads reduced gradients and moves nothing, and the step moves what eager's moves."""
    from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan, zero_plan

    ranks, module_plan, batch = OPT_PLANS[plan]
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_embd=16)
    g = torch.Generator().manual_seed(1)
    IDX, TGT = (torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g) for _ in range(2))
    want = {}
    for mode in ("eager", "compiled"):  # one device, the same program
        torch.manual_seed(0)
        ref = GPT(cfg).double()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
        step = ref_opt.step if mode == "eager" else torch.compile(ref_opt.step, backend="aot_eager")
        want[mode] = []
        for _ in range(3):
            ref(IDX, TGT)[1].backward()
            step()
            ref_opt.zero_grad()
            want[mode].append({n: q.detach().clone() for n, q in ref.named_parameters()})
    torch._dynamo.reset()
    cap = Capture()

    def body():
        p = gt.placement("cpu", ranks)
        layout = {"dp": gt.split(0), "dp2": dp_batch(0, 2)}[batch]
        out = {}
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            model = gt.to_global(GPT(cfg).double(), p, {None: None, "tp": tp_plan(1, 2),
                                                         "zero3": zero_plan(0, 1)}[module_plan])
            idx, tgt = gt.to_global(IDX, p, layout), gt.to_global(TGT, p, layout)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

            def loss_of(idx, tgt):
                return model(idx, tgt)[1]
            fwd, step = (loss_of, opt.step) if mode == "eager" else (
                torch.compile(loss_of, backend=cap.backend, fullgraph=True),
                torch.compile(opt.step, backend=cap.backend))
            steps, graphs = [], []
            for _ in range(3):
                fwd(idx, tgt).backward()
                with gt.comm_log() as log:
                    step()
                opt.zero_grad()
                steps.append(({n: _full(q).clone() for n, q in model.named_parameters()}, log.summary()))
                graphs.append(cap.compiles(gt.rank()))
            out[mode] = (steps, graphs)
        return out

    for rank, out in enumerate(gt.launch(body, len(gt.placement("cpu", ranks).flat_ranks))):
        (steps, graphs), (esteps, _) = out["compiled"], out["eager"]
        for s, ((params, log), (eparams, elog)) in enumerate(zip(steps, esteps)):
            for name, v in params.items():
                torch.testing.assert_close(v, want["compiled"][s][name], rtol=0, atol=1e-12, msg=name)
                torch.testing.assert_close(eparams[name], want["eager"][s][name], rtol=0, atol=1e-12, msg=name)
                # (compiled and eager differ as on one device: compiled, torch's AdamW computes its bias corrections
                # from the fp32 step counter, eagerly from its `.item()`, a Python float)
            assert log == elog  # DP: the gradient bucket's all-reduce, eagerly at the step's start
        assert graphs[0] == graphs[1] == graphs[2] >= 2  # the loss's graph and the update's, compiled once
        assert cap.aten_only(rank)
        update = cap.graphs[rank]["fw"][1:]  # after the loss's: the step's
        assert not any(str(n.target).startswith("globaltensor.") for gm in update for n in gm.graph.nodes)
        assert any("addcdiv" in str(n.target) for gm in update for n in gm.graph.nodes)  # the update is there
    breaks = dict(counters["graph_break"])
    assert all("graph_break()" in why or "disable" in why for why in breaks), breaks


def _train(make, loss_of, inputs, ranks=None, plan=None, layout=None, cap=None, steps=2, lr=1e-2,
           around=contextlib.nullcontext, step_backend=None):
    """`steps` training steps of the model `make()` (seeded alike each time): the loss `loss_of(model, *inputs)`,
    its backward, an AdamW step. On one device when `ranks` is None, else on simulated ranks of that mesh with
    the model placed by `plan(model)` and the inputs laid out `layout`, eagerly, or with the loss compiled
    (`fullgraph=True` on `cap`'s backend) when `cap` is given. Per rank (one device: a one-item list), per
    step: (loss, {name: gradient}, {name: parameter after the step}, the forward + backward's comm_log summary
    and bytes, the step's summary), all whole. `around()`: a context each rank runs its steps in."""
    def run():
        torch.manual_seed(0)
        model = make()
        args = list(inputs)
        if ranks is not None:
            p = gt.placement("cpu", ranks)
            gt.to_global(model, p, plan(model))
            args = [gt.to_global(t, p, layout) for t in args]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
        update = opt.step if step_backend is None else torch.compile(opt.step, backend=step_backend)

        def step(*a):
            return loss_of(model, *a)
        fn = step if cap is None else torch.compile(step, backend=cap.backend, fullgraph=True)
        out = []
        for _ in range(steps):
            opt.zero_grad()
            with around(), gt.comm_log() as log:
                loss = fn(*args)
                loss.backward()
            with gt.comm_log() as at_step:  # DP's pending gradients are reduced at their first read: here
                grads = {n: _full(q.grad) for n, q in model.named_parameters()}
                update()
            out.append((_full(loss), grads, {n: _full(q).clone() for n, q in model.named_parameters()},
                        log.summary(), log.recv_bytes, at_step.summary()))
        return out
    if ranks is None:
        return [run()]
    return gt.launch(run, len(gt.placement("cpu", ranks).flat_ranks))


def _assert_compiled_as_eager(cap, compiled, eager, one, atol, step_cap=None, beyond=None):
    """Each rank's compiled steps equal one device's run alike (`one`) and its eager steps (loss, gradients,
    parameters after AdamW) to `atol` (fp32 values, as HF's loss of an fp64 model: 1e-6), move what eager moves,
    and the forward + backward's bytes are exactly the graphs' collectives priced (`_priced`); each rank compiled
    one forward and one backward graph on the first step (none on the next: no recompile), of local aten ops and
    our collectives only; no graph break. With `step_cap` AdamW's step was compiled too (on its backend): one
    graph per rank, no collective in it (the gradient bucket is settled before it, eagerly); its arithmetic is
    then not eager's (bias corrections from the fp32 step counter), so against eager only the first step's loss
    and gradients are compared, and the only breaks are torch.optim's and the settling's."""
    (want,) = one
    for rank, (steps, esteps) in enumerate(zip(compiled, eager)):
        graph = cap.collectives(rank, "fw") + cap.collectives(rank, "bw")
        for s, (got, ref, dev) in enumerate(zip(steps, esteps, want)):
            for i, what in enumerate(("loss", "grad", "param")):
                a, b, c = got[i], ref[i], dev[i]
                as_eager = step_cap is None or (s == 0 and what != "param")
                for name in (a if isinstance(a, dict) else [None]):
                    x, y, z = (t[name] if name is not None else t for t in (a, b, c))
                    tol = atol if x.dtype == torch.float64 else 1e-6  # an fp64 model's fp32 loss (HF's)
                    msg = f"rank {rank} step {s} {what} {name}"
                    torch.testing.assert_close(x, z, rtol=0, atol=tol, msg=msg)
                    if as_eager:
                        torch.testing.assert_close(x, y, rtol=0, atol=tol, msg=msg)
            if beyond is None:
                assert got[3] == ref[3] and got[5] == ref[5], (rank, s)  # what moves: eager's
            elif beyond == "no more":  # the step's bytes split otherwise between backward and bucket, none more
                assert sum(got[3].values()) + sum(got[5].values()) <= sum(ref[3].values()) + sum(ref[5].values())
            else:  # what moves: eager's, and `beyond` more in the forward + backward, exactly
                assert {k: v for k, v in got[3].items() if v} == \
                    {k: ref[3].get(k, 0) + beyond.get(k, 0) for k in set(ref[3]) | set(beyond)} and \
                    got[5] == ref[5], (rank, s, got[3], ref[3])
            assert sum(b for _, _, b in graph) == got[4] > 0, (rank, s, graph, got[4])
        assert cap.compiles(rank) == 1 and len(cap.graphs[rank]["bw"]) == 1, rank
        assert cap.aten_only(rank), rank
        if step_cap is not None:
            assert step_cap.compiles(rank) == 1 and step_cap.aten_only(rank), rank
            update = [str(n.target) for gm in step_cap.graphs[rank]["fw"] for n in gm.graph.nodes]
            assert "aten._foreach_addcdiv_.ScalarList" in update or any("addcdiv" in n for n in update), update
            assert not any(n.startswith("globaltensor.") for n in update), update
    breaks = dict(counters["graph_break"])
    assert breaks == {} if step_cap is None else all("graph_break()" in w or "disable" in w for w in breaks), breaks


@pytest.mark.slow
def test_hf_llama_compiles_under_dp_x_tp_from_its_own_plan():
    """A model nobody here wrote: transformers' Llama (tests/hf_zoo.py's tiny config, fp64), on a 2 x 2
    (data, tensor) mesh placed by its own TP plan alone (`gt.hf.tp_plan`, the batch split on the data axis),
    its loss compiled with `fullgraph=True` and AdamW's step compiled: two steps of forward + backward + AdamW
    equal one device compiled alike and eager globaltensor (`_assert_compiled_as_eager`), the graphs'
    collectives are the bytes `gt.comm_log()` counts, no graph break in the loss, no recompile.
    Slow: each of the 4 simulated ranks traces its own graphs (~40 s on 2 cores)."""
    pytest.importorskip("transformers")
    import hf_zoo

    arch = hf_zoo.ZOO["llama"]
    ids = arch.batch()["input_ids"][:4, :8]

    def loss_of(model, ids):
        return model(input_ids=ids, labels=ids).loss
    run = dict(make=arch.build, loss_of=loss_of, inputs=[ids], ranks=[[0, 1], [2, 3]],
               plan=lambda m: hf_zoo.plan_for("dp_tp", m), layout=hf_zoo.batch_sbp("dp_tp"))
    cap, step_cap = Capture(), Capture()
    compiled = _train(**run, cap=cap, step_backend=step_cap.backend)
    torch._dynamo.reset()
    one = _train(arch.build, loss_of, [ids], step_backend="aot_eager")
    _assert_compiled_as_eager(cap, compiled, _train(**run), one, atol=1e-12, step_cap=step_cap,
                              beyond=TRACED_WITHOUT_SINKS["hf_llama"])


def _gpt_strategy(name: str) -> dict:
    """`_train`'s arguments for a GPT strategy not covered above (fp64, one layer)."""
    from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, seq_batch, ulysses_plan, zero_plan
    from globaltensor.models.moe import MoEConfig, MoEGPT, ep_batch, moe_gpt_plan

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_embd=16)
    batch = 1 if name == "ulysses" else 4  # Ulysses: one sequence per rank group (`ulysses_plan`)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g) for _ in range(2)]
    run = dict(make=lambda: GPT(cfg).double(), loss_of=lambda m, i, t: m(i, t)[1], inputs=inputs)
    if name == "zero3_tp":  # FSDP + TP: ZeRO-3 on the data axis, Megatron on the tensor axis
        return dict(run, ranks=[[0, 1], [2, 3]], plan=lambda m: zero_plan(0, 2, 1), layout=dp_batch(0, 2))
    if name == "ulysses":
        return dict(run, ranks=[0, 1], plan=lambda m: ulysses_plan(0, 1), layout=seq_batch(0, 1))
    if name == "moe":  # GShard's capacity routing (static shapes), experts split over the ranks
        mcfg = MoEConfig(**{**cfg.__dict__, "n_expert": 4, "expert_hidden": 16})
        return dict(run, make=lambda: MoEGPT(mcfg).double(), ranks=[0, 1], plan=lambda m: moe_gpt_plan(0, 1),
                    layout=ep_batch(1))
    raise ValueError(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_tp", "ulysses", "moe"])
def test_gpt_strategies_compile_as_eager_and_one_device(name):
    """More strategies on the GPT (fp64, one layer) with the loss compiled (`fullgraph=True`) and AdamW's
    step compiled, two steps of forward + backward + AdamW: ZeRO-3 x TP on a 2 x 2 (data, tensor) mesh
    (`zero_plan(0, 2, 1)`: gathers and reduce-scatters on the data axis, Megatron's all-reduces on the tensor
    axis, in one graph); Ulysses
    (`ulysses_plan`: the all-to-alls between sequence and heads splits); the MoE-GPT under expert parallelism
    (`moe_gpt_plan`, capacity routing: the dispatch and combine all-to-alls, and `one_hot`'s traced range checks
    asserted on each rank's shard, moving nothing). Each equals one device compiled alike and eager
    globaltensor to 1e-12 (`_assert_compiled_as_eager`), moves what eager moves, its graphs' collectives priced
    at exactly the bytes `gt.comm_log()` counts; no graph break in the loss, no recompile on step 2. Slow:
    ~15 s (2 ranks) to ~60 s (4 ranks) of tracing on 2 cores."""
    run = _gpt_strategy(name)
    cap, step_cap = Capture(), Capture()
    compiled = _train(**run, cap=cap, step_backend=step_cap.backend)
    torch._dynamo.reset()
    one = _train(run["make"], run["loss_of"], run["inputs"], step_backend="aot_eager")
    _assert_compiled_as_eager(cap, compiled, _train(**run), one, atol=1e-12, step_cap=step_cap,
                              beyond=TRACED_WITHOUT_SINKS.get(name))
    kinds = {k for r in cap.graphs for kind in ("fw", "bw") for k, _, _ in cap.collectives(r, kind)}
    assert kinds >= {"zero3_tp": {"all_gather", "reduce_scatter", "all_reduce"}, "ulysses": {"all_to_all"},
                     "moe": {"all_to_all"}}[name]


def test_ulysses_attention_compiles_with_its_all_to_alls_in_the_graphs():
    """Attention on q, k, v split on the sequence under `gt.attention_method("ulysses")` (set outside the
    compiled function: it is read when AOTAutograd traces), compiled with `fullgraph=True`: the forward graph
    holds the all-to-alls from the sequence to the heads split; the output and the input gradients equal
    eager's and one device's, the graphs priced at `gt.comm_log()`'s bytes: half of eager's, whose backward
    converts the leaves again. (The GPT under `ulysses_plan`: the slow test above.)"""
    torch.manual_seed(0)
    Q, K, V = (torch.randn(1, 4, 8, 4, dtype=torch.float64) for _ in range(3))
    ref = [t.clone().requires_grad_(True) for t in (Q, K, V)]
    attend = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    attend(*ref).square().sum().backward()
    cap = Capture()

    def body():
        p = gt.placement("cpu", [0, 1])
        out = {}
        for mode in ("eager", "compiled"):
            qkv = [gt.to_global(t, p, gt.split(2)).requires_grad_(True) for t in (Q, K, V)]
            fn = attend if mode == "eager" else torch.compile(attend, backend=cap.backend, fullgraph=True)
            with gt.attention_method("ulysses"), gt.comm_log() as log:
                y = fn(*qkv)
                y.square().sum().backward()
            out[mode] = (_full(y), [_full(t.grad) for t in qkv], log.summary(), log.recv_bytes)
        return out

    want = attend(Q, K, V)
    for rank, out in enumerate(gt.launch(body, 2)):
        (y, grads, log, nbytes), (ey, egrads, elog, _) = out["compiled"], out["eager"]
        torch.testing.assert_close(y, want, rtol=0, atol=1e-12), torch.testing.assert_close(y, ey, rtol=0, atol=1e-12)
        for g, eg, r in zip(grads, egrads, ref):
            torch.testing.assert_close(g, r.grad, rtol=0, atol=1e-12)
            torch.testing.assert_close(g, eg, rtol=0, atol=1e-12)
        fw, bw = cap.collectives(rank, "fw"), cap.collectives(rank, "bw")
        # q, k, v from the sequence to the heads split; the output stays so (the loss needs nothing else), and so
        # do the inputs' gradients (a gradient keeps the layout its backward gives it). The backward reads the
        # converted q, k, v the forward graph saved: it moves nothing, where eager's converts the three leaves
        # again (a leaf keeps its layout: `ops/program._keep`), as many bytes again
        assert {k for k, _, _ in fw} == {"all_to_all"} and len(fw) == 3 and bw == []
        assert sum(b for _, _, b in fw) == nbytes == 3 * 4 * 4 * 4 * 8 // 2  # (n-1)/n of each [1, 4, 8, 4] / 2
        assert log == {"all_to_all": nbytes} and elog == {"all_to_all": 2 * nbytes}
        assert cap.aten_only(rank)
    assert dict(counters["graph_break"]) == {}


def test_traced_checks_run_on_each_ranks_shard():
    """`one_hot` traced leaves its range checks in the graph (`all` of a test, `_assert_async`): on a split
    input each rank asserts its own shard's `all` (a P(min): the global truth is every rank's), so the checks
    move nothing, and a value out of range still raises."""
    cap = Capture()

    def body(top):
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.tensor([[0, 1, 2], [3, 1, top]]), p, gt.split(0))
        with gt.comm_log() as log:
            y = torch.compile(lambda x: torch.nn.functional.one_hot(x, 4), backend=cap.backend, fullgraph=True)(x)
        return _full(y), log.recv_bytes

    want = torch.nn.functional.one_hot(torch.tensor([[0, 1, 2], [3, 1, 0]]), 4)
    for y, nbytes in gt.launch(lambda: body(0), 2):
        assert torch.equal(y, want) and nbytes == 0
    asserts = [n for n in cap.graphs[0]["fw"][0].graph.nodes if "_assert_async" in str(n.target)]
    assert len(asserts) == 2 and cap.collectives(0, "fw") == []
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="smaller than num_classes"):  # rank 1's shard holds the 4
        gt.launch(lambda: body(4), 2)


def test_ring_attention_and_the_dropless_dispatch_refuse_at_trace_time():
    """What cannot be traced says so when dynamo meets it (`fullgraph=True`), never a wrong value: ring
    attention passes key/value blocks point to point (no graph op); a dropless MoE's dispatch (`by_expert`)
    has rows per expert that are data, so dynamo stops at it (`torch.compiler.disable` with the reason), as
    at `gt.attention_method` entered inside the compiled function."""
    from globaltensor.models.moe import MoEConfig, MoEGPT, moe_gpt_plan

    def ring():
        p = gt.placement("cpu", [0, 1])
        q, k, v = (gt.to_global(torch.randn(1, 4, 8, 4), p, gt.split(2)) for _ in range(3))
        with gt.attention_method("ring"):
            torch.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                          backend="aot_eager", fullgraph=True)(q, k, v)

    with pytest.raises(Exception, match="point-to-point exchange cannot be captured"):
        gt.launch(ring, 2)

    def method_inside():  # the method is read when AOTAutograd traces: set outside the compiled function
        p = gt.placement("cpu", [0, 1])
        q, k, v = (gt.to_global(torch.randn(1, 4, 8, 4), p, gt.split(2)) for _ in range(3))

        def f(q, k, v):
            with gt.attention_method("ulysses"):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)

    with pytest.raises(Exception, match="set it outside the compiled function"):
        gt.launch(method_inside, 2)

    cfg = MoEConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_embd=16, n_expert=4, expert_hidden=16,
                    dropless=True)

    def dropless():
        p = gt.placement("cpu", [0, 1])
        model = gt.to_global(MoEGPT(cfg), p, moe_gpt_plan(0, 1, dropless=True))
        idx = gt.to_global(torch.zeros(4, 8, dtype=torch.long), p, gt.split(0))
        torch.compile(lambda i: model(i, i)[1], backend="aot_eager", fullgraph=True)(idx)

    with pytest.raises(Exception, match="dropless MoE's rows per expert are data"):
        gt.launch(dropless, 2)
