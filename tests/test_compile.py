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

import threading

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
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
        self.backend = aot_autograd(fw_compiler=self._keep("fw"), bw_compiler=self._keep("bw"))

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
    and its dual, one all-gather of the gradient, backward. Each rank receives (n-1)/n of the [8, 3]
    product forward and of its gradient backward: 4*3 floats on 2 ranks, each way."""
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
        assert bw == ebw == {"all_gather": want_bytes}
        assert cap.aten_only(rank)
    # each rank traced its own graph (its own chunk of the reduce-scatter): the rank is in the guarded metadata
    idx = [[n.args[3] for n in cap.graphs[r]["fw"][0].graph.nodes if "reduce_scatter" in str(n.target)]
           for r in (0, 1)]
    assert idx == [[0], [1]]
    assert dict(counters["graph_break"]) == {}
