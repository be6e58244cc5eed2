"""Nodes (issue 37): which ranks share a node, bytes between nodes priced dearer, and counted apart.

The simulator models G ranks per node (`gt.launch(..., ranks_per_node=G)`, as torchrun numbers them: node k
holds ranks k*G .. k*G + G - 1); placements made there carry it, the boxing planner prices a byte between
nodes by the across link's beta (8x the inside one's: `Topology.across_cost`), and `gt.comm_log().by_link()`
splits what a rank received into collectives inside a node and those spanning nodes. The textbook is the hierarchical all-reduce (NCCL's
tree/ring over nodes, Megatron's and HSDP's layout): reduce-scatter inside a node, all-reduce across nodes on
1/G of the tensor, all-gather inside, so each rank receives 2(s/G)(N-1)/N bytes across nodes for a tensor of
s bytes over N nodes, where a flat all-reduce over the same ranks moves 2s(N-1)/N across.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor.boxing.cost import across_bytes, link_bytes
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan
from globaltensor.runtime.topology import Topology

P, B = gt.partial_sum, gt.broadcast


def _node_major(nodes: int, per_node: int) -> list:
    """Mesh axis 0 across nodes, axis 1 inside: [[ranks of node 0], [ranks of node 1], ...]."""
    return [[k * per_node + i for i in range(per_node)] for k in range(nodes)]


def _local_major(nodes: int, per_node: int) -> list:
    """The same ranks with the axes swapped: axis 0 inside nodes, axis 1 across."""
    return [[k * per_node + i for k in range(nodes)] for i in range(per_node)]


@given(st.sampled_from([2, 3]), st.sampled_from([2, 3]), st.booleans(), st.booleans(), st.integers(1, 3))
def test_a_partial_over_nodes_is_reduced_inside_first_and_across_on_one_gth(nodes, per_node, node_major,
                                                                          partial_inside, scale):
    """(P across nodes, P or B inside) -> Broadcast: each rank receives exactly 2(s/G)(N-1)/N bytes across
    nodes (the hierarchical all-reduce), whichever mesh axis the nodes are, and the inside bytes of a
    reduce-scatter and an all-gather over G (only the all-gather where the inside axis was Broadcast).
    Values equal the plain sum. The planner blind to nodes moves more across for the same conversion."""
    n, g = nodes, per_node
    numel = n * g * 8 * scale
    ranks = _node_major(n, g) if node_major else _local_major(n, g)
    across_axis = 0 if node_major else 1
    src = [P, P]
    if not partial_inside:
        src[1 - across_axis] = B

    def body():
        p = gt.placement("cpu", ranks)
        here = p.coord(gt.rank())
        # Partial inside: every rank its own term; Broadcast inside: the node's ranks hold the node's term
        torch.manual_seed(gt.rank() if partial_inside else 100 + here[across_axis])
        mine = torch.randn(numel, dtype=torch.float64)
        x = gt.from_local(mine, p, tuple(src), shape=(numel,))
        with gt.comm_log() as log:
            y = x.to_global(p, (B, B))
        return y.to_local(), mine if partial_inside or here[1 - across_axis] == 0 else None, log.by_link()
    results = gt.launch(body, n * g, ranks_per_node=g)
    s = numel * 8
    want = sum(m for _, m, _ in results if m is not None)
    for out, _, links in results:
        torch.testing.assert_close(out, want)
        assert links["across"] == 2 * (s // g) * (n - 1) // n
        assert links["inside"] == (2 if partial_inside else 1) * s * (g - 1) // g
    placement = gt.placement("cpu", ranks)  # outside the launch: blind to nodes
    blind = gt.boxing.route(gt.Layout(placement, tuple(src)), gt.Layout(placement, (B, B)), (numel,), torch.float64)
    assert sum(link_bytes(step, Topology(g))[1] for step in blind.steps) >= n * g * 2 * (s // g) * (n - 1) // n


CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def test_gpt_data_parallel_across_nodes_tensor_parallel_inside():
    """The GPT on [[0, 1], [2, 3]] with 2 ranks per node: data axis across the nodes, Megatron TP inside. In a
    training step every tensor-parallel collective stays inside a node; what crosses is the data axis' gradient
    reduction at its hierarchical bound: a TP-split parameter's shard all-reduced over the N nodes,
    2s(N-1)/N, a TP-replicated one's halves each by one rank of the node, 2(s/G)(N-1)/N, plus the loss's
    scalar. The losses and parameters equal the same step with every rank on one node."""
    def body():
        torch.manual_seed(0)
        model = GPT(CFG)
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        gt.to_global(model, p, tp_plan(tensor_axis=1, ndim=2))
        data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
        idx = gt.to_global(data[:, :-1], p, dp_batch(data_axis=0, ndim=2))
        tgt = gt.to_global(data[:, 1:], p, dp_batch(data_axis=0, ndim=2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with gt.comm_log() as log:
            _, loss = model(idx, tgt)
            loss.backward()
            opt.step()
        bound = 0
        for q in model.parameters():
            s = q.to_local().numel() * 4
            bound += 2 * (s if isinstance(q.sbp[1], gt.Split) else s // 2) * (2 - 1) // 2
        tp_groups = {tuple(sorted(g)) for g in ([0, 1], [2, 3])}
        crossing_tp = [e for e in log.events if e.across and tuple(sorted(e.group)) in tp_groups]
        return (loss.full_tensor().item(), {n: q.full_tensor() for n, q in model.named_parameters()},
                log.by_link(), bound, crossing_tp, [e.group for e in log.events if e.across])
    two_nodes = gt.launch(body, 4, ranks_per_node=2)
    one_node = gt.launch(body, 4)
    for (loss, params, links, bound, crossing_tp, groups), (loss1, params1, *_) in zip(two_nodes, one_node):
        assert crossing_tp == [] and all(sorted(g) in ([0, 2], [1, 3]) for g in groups)
        assert links["across"] == bound + 4  # + the loss's float32 scalar, all-reduced over the data axis
        assert loss == loss1
        for n, q in params.items():
            torch.testing.assert_close(q, params1[n], rtol=1e-6, atol=1e-7)


def test_hsdp_shards_inside_a_node_and_replicates_across():
    """HSDP: parameters stored split over the ranks of a node and replicated across nodes, gathered while
    they run. Its gathers never leave a node; its gradients are reduce-scattered inside and all-reduced
    across on 1/G: exactly 2(Ψ/G)(N-1)/N bytes cross per rank in a step; values equal one device."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    ref = copy.deepcopy(net)
    ref(x).square().mean().backward()
    psi = sum(q.numel() for q in net.parameters()) * 8

    def body():
        p = gt.placement("cpu", [[0, 1], [2, 3]])   # node x local
        m = gt.to_global(copy.deepcopy(net), p, {"*": (B, gt.split(0)), "": gt.ModuleLayout(params=(B, B))})
        with gt.comm_log() as log:
            m(gt.to_global(x, p, (gt.split(0), gt.split(0)))).square().mean().backward()
            grads = {n: q.grad.to_global(p, (B, gt.split(0))) for n, q in m.named_parameters()}
        gathers_across = [e for e in log.events if e.across and e.kind == "all_gather"]
        return {n: g.full_tensor() for n, g in grads.items()}, log.by_link(), gathers_across
    for grads, links, gathers_across in gt.launch(body, 4, ranks_per_node=2):
        assert gathers_across == []
        assert links["across"] == 2 * (psi // 2) * (2 - 1) // 2
        for n, q in ref.named_parameters():
            torch.testing.assert_close(grads[n], q.grad)


def test_bad_topologies_are_refused_by_name():
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology(0)
    with pytest.raises(ValueError, match="beta"):  # a byte across nodes is priced by the link model's betas
        gt.Link(10e-6, 0.0)
    with pytest.raises(ValueError, match="simulator only"):
        gt.launch(lambda: None, 2, backend="gloo", ranks_per_node=1)


def test_torchrun_environment_says_how_many_ranks_a_node_has(monkeypatch):
    monkeypatch.delenv("GT_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.from_environment() == Topology(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert Topology.from_environment() == Topology()  # one node
    monkeypatch.setenv("GT_RANKS_PER_NODE", "2")
    assert Topology.from_environment() == Topology(2)


def test_node_mesh_lays_the_jobs_ranks_out_by_node():
    """gt.node_mesh(): axis 0 across the nodes, axis 1 inside one; `axis_kind` names each axis' link class."""
    def body():
        mesh = gt.node_mesh()
        return mesh.ranks, mesh.axis_kind, gt.placement("cpu", [[0, 3], [1, 4], [2, 5]]).axis_kind
    assert gt.launch(body, 6, ranks_per_node=3)[0] == ([[0, 1, 2], [3, 4, 5]], ("across", "inside"),
                                                      ("inside", "across"))
    assert gt.launch(body, 6, ranks_per_node=2)[0][:2] == ([[0, 1], [2, 3], [4, 5]], ("across", "inside"))
    assert gt.launch(lambda: (gt.node_mesh().ranks, gt.node_mesh().axis_kind), 4)[0] == ([[0, 1, 2, 3]],
                                                                                         ("inside", "inside"))
    with pytest.raises(ValueError, match="whole nodes"):
        gt.launch(gt.node_mesh, 5, ranks_per_node=2)


@pytest.mark.parametrize("op", [torch.maximum, torch.mul])
def test_an_op_takes_each_piece_from_a_holder_on_its_own_node(op):
    """`op(a, b)` with a split over nodes (S(0), B) and b split inside them (B, S(0)) on 2 nodes x 2: both are cut
    to (S(0), S(0)) (a for free, b by a point-to-point exchange: ranks (0, 1) and (1, 0) each lack one quarter,
    held by one rank on each node). Every piece comes from the holder on the receiver's node: 0 bytes across
    nodes, where the planner blind to nodes takes both from the other node. The per-op choice prices bytes
    between nodes dearer too (`decide.conversion_cost`, priced by the link model's betas): before the exchange
    chose holders by node, it paid an all-gather inside each node (64 B a rank) rather than the exchange it priced across."""
    a_full, b_full = torch.arange(16, dtype=torch.float64), torch.arange(16, dtype=torch.float64) * 10

    def body():
        p = gt.placement("cpu", _node_major(2, 2))
        a = gt.to_global(a_full, p, (gt.split(0), B))
        b = gt.to_global(b_full, p, (B, gt.split(0)))
        with gt.comm_log() as log:
            out = op(a, b)
        assert torch.equal(out.full_tensor(), op(a_full, b_full))
        route = gt.boxing.route(gt.Layout(p, b.sbp), gt.Layout(p, (gt.split(0), gt.split(0))), (16,), torch.float64)
        return out.sbp, log.by_link(), [sum(across_bytes(s, Topology(2))) for s in route.steps]

    aware = gt.launch(body, 4, ranks_per_node=2)
    assert [r[0] for r in aware] == [(gt.split(0), gt.split(0))] * 4
    assert [r[1] for r in aware] == [{"inside": b, "across": 0} for b in (0, 32, 32, 0)]
    assert aware[0][2] == [0]
    assert gt.launch(body, 4)[0][2] == [64]  # blind: ranks 1 and 2 each receive their quarter from the other node
