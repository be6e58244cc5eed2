"""`gt.auto_plan` (globaltensor/planning.py): the textbook plans come out where they are optimal, its predicted
bytes and collectives are what a real simulator step of the plan receives, its plans train as one device does,
and no plan of the family it searches beats it on predicted time within the budget."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, sp_plan, tp_plan
from globaltensor.planning import Figures, measure, step_time

TP = {"tp": tp_plan}


def gpt(n_layer=2, n_embd=16, n_head=4, vocab=32, block=16, dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)).to(dtype)


def batch(rows: int, vocab=32, block=16) -> tuple:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (rows, block), generator=g)
    return idx, idx


def uniform(auto: gt.AutoPlan, strategy: str, tensor_plan=None):
    """The family's hand plan that uses `strategy` for the root and every block (on the data axes only, or with
    `tensor_plan` on the tensor axis)."""
    return next(c for c in auto.candidates if c.root == strategy and dict(c.blocks).get(strategy) == auto.depth
                and c.axes.tensor_plan == tensor_plan)


def peak(f: Figures, r: int) -> int:
    return f.persistent[r] + f.activations[r] + f.gathered[r]


def test_dp_when_everything_fits():
    model, inputs = gpt(n_layer=3), batch(8)
    auto = gt.auto_plan(model, inputs, gt.placement("cpu", [0, 1, 2, 3]), tensor_plans=TP)
    assert auto.chosen.root == "dp" and dict(auto.chosen.blocks)["dp"] == 3 and auto.chosen.axes.tensor is None
    assert auto.plan == {}  # every parameter Broadcast: data parallelism, gradients all-reduced in one bucket
    assert auto.predicted["collectives"] == (2,) * 4  # the loss's scalar and one bucket of gradients


def test_zero3_when_only_zero3_fits_with_the_textbook_bytes():
    """strategies.md's ZeRO-3 example (Ψ = 7,360 on 4 ranks): 3Ψ(n-1)/n x 4 B, plus the loss's 12-byte all-reduce."""
    model, inputs = gpt(n_layer=2), batch(16)
    mesh = gt.placement("cpu", [0, 1, 2, 3])
    free = gt.auto_plan(model, inputs, mesh)
    least = min(c.peak_memory for c in free.candidates)
    auto = free.within(least)  # the same search under another budget, nothing measured again
    assert auto.chosen.root == "zero3" and dict(auto.chosen.blocks) == {"dp": 0, "zero2": 0, "zero3": 2}
    psi = sum(p.numel() for p in model.parameters())
    assert psi == 7360 and auto.predicted["recv_bytes"][0] == 3 * psi * 3 // 4 * 4 + 12 == 66252
    assert auto.predicted["max"]["peak_memory"] == least
    assert "next best" in auto.explain() and "over budget" in auto.explain()


def test_tensor_parallel_within_an_axis_when_it_is_cheapest():
    """Wide layers, few tokens: Megatron's activations cost less than the weights' gradients on a 2x2 mesh."""
    model, inputs = gpt(n_layer=2, n_embd=128, n_head=4, vocab=64, block=8), batch(4, vocab=64, block=8)
    auto = gt.auto_plan(model, inputs, gt.placement("cpu", [[0, 1], [2, 3]]), tensor_plans=TP)
    assert auto.chosen.axes.tensor is not None and len(auto.chosen.axes.data) == 1, auto.explain()
    dp = uniform(auto, "dp")
    assert auto.chosen.time < dp.time and max(auto.chosen.figures.recv_bytes) < max(dp.figures.recv_bytes)


def test_too_small_a_budget_names_the_smallest_that_works():
    model, inputs = gpt(n_layer=2), batch(8)
    mesh = gt.placement("cpu", [0, 1])
    with pytest.raises(ValueError, match="no plan of the family fits") as raised:
        gt.auto_plan(model, inputs, mesh, memory_per_rank=1)
    free = gt.auto_plan(model, inputs, mesh)
    least = min(c.peak_memory for c in free.candidates)
    assert f"smallest memory_per_rank that works is {least:,} bytes" in str(raised.value)
    assert free.within(least).predicted["max"]["peak_memory"] == least
    with pytest.raises(ValueError, match=f"{least:,} bytes"):
        free.within(least - 1)


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_predicted_bytes_are_measured_for_every_hand_plan_and_the_choice(shape):
    """Each uniform plan of the family and the chosen (mixed) one, run for a step on the simulator with values: each
    rank receives the predicted bytes in the predicted collectives, and stores what was predicted; its peak is within
    issue 38's 10% of the prediction: the activations saved differ from the dry run's where a ZeRO block runs as a
    plain region, whose kernels see meta shards in the dry run (scaled_dot_product_attention's math path on meta,
    CPU's flash kernel with values: other saved tensors)."""
    model, inputs = gpt(n_layer=3), batch(8)
    ranks = list(range(4)) if shape == (4,) else [[0, 1], [2, 3]]
    mesh = gt.placement("cpu", ranks)
    free = gt.auto_plan(model, inputs, mesh, tensor_plans={"tp": tp_plan, "tp+sp": sp_plan})
    z3 = uniform(free, "zero3")
    budget = (z3.peak_memory + uniform(free, "zero2").peak_memory) / 2  # mixes ZeRO-2 and ZeRO-3 blocks
    auto = free.within(budget)
    hands = [uniform(free, s) for s in ("dp", "zero2", "zero3")] + [
        c for c in free.candidates if c.axes.tensor is not None and c.root == "dp"
        and dict(c.blocks).get("dp") == 3]
    assert len(hands) == (5 if shape == (4,) else 7)
    for c in hands + [auto.chosen]:
        sbp = gt.planning.batch_sbp(c.axes, mesh.ndim)
        got = measure(model, inputs, mesh, free.plan_of(c), sbp=sbp, dry=False)
        assert got.recv_bytes == c.figures.recv_bytes and got.collectives == c.figures.collectives, c
        assert got.persistent == c.figures.persistent and got.gathered == c.figures.gathered, c
        for r in range(4):
            assert abs(peak(got, r) - peak(c.figures, r)) <= 0.1 * peak(got, r), c
            if all(k == 0 for s, k in c.blocks if s != "dp") and c.root == "dp":  # no plain region: the same tensors
                assert got.activations[r] == c.figures.activations[r], c
    assert auto.chosen.peak_memory <= budget < free.chosen.peak_memory
    if shape == (4,):  # a plan no hand writes: ZeRO-3 blocks beside ZeRO-2 (or a root of another strategy)
        assert auto.chosen not in hands and dict(auto.chosen.blocks)["zero3"] > 0, auto.explain()


def _train(model: torch.nn.Module, plan: dict, mesh_ranks, sbp, inputs) -> tuple:
    mesh = gt.placement("cpu", mesh_ranks)
    model = gt.to_global(copy.deepcopy(model), mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = (gt.to_global(t, mesh, sbp) for t in inputs)
    loss = model(x, y)[1]
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    return loss.full_tensor(), grads, {n: p.full_tensor() for n, p in model.named_parameters()}


def _one_device(model: torch.nn.Module, inputs) -> tuple:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(*inputs)[1]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shape,budget", [((4,), "mixed"), ((2, 2), "free")])
def test_the_chosen_plan_trains_as_one_device(shape, budget):
    """fp64, one AdamW step: loss, gradients and parameters equal one device's to 1e-10 (a mixed ZeRO-2/ZeRO-3 plan
    on 4 ranks; the 2x2 choice with a tensor axis)."""
    model = gpt(n_layer=3, dtype=torch.float64) if shape == (4,) else gpt(n_layer=2, n_embd=64, vocab=64, block=8,
                                                                          dtype=torch.float64)
    inputs = batch(8) if shape == (4,) else batch(4, vocab=64, block=8)
    ranks = [0, 1, 2, 3] if shape == (4,) else [[0, 1], [2, 3]]
    mesh = gt.placement("cpu", ranks)
    free = gt.auto_plan(model, inputs, mesh, tensor_plans=TP)
    memory = (uniform(free, "zero3").peak_memory + uniform(free, "zero2").peak_memory) / 2 if budget == "mixed" \
        else math.inf
    auto = free.within(memory)
    if budget == "mixed":
        assert len([k for _, k in auto.chosen.blocks if k]) >= 2 or auto.chosen.root != dict(auto.chosen.blocks), \
            auto.explain()
    else:
        assert auto.chosen.axes.tensor is not None, auto.explain()
    want = _one_device(model, inputs)
    for got in gt.launch(_train, 4, args=(model, auto.plan, ranks, auto.predicted["batch_sbp"], inputs)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
        for g, w in zip(got[1:], want[1:]):
            assert g.keys() == w.keys()
            for n in w:
                torch.testing.assert_close(g[n], w[n], rtol=0, atol=1e-10, msg=n)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(depth=st.integers(1, 3), width=st.sampled_from([16, 32]), heads=st.sampled_from([2, 4]),
       world=st.sampled_from([2, 4]), fraction=st.floats(0.0, 1.0))
def test_within_the_budget_no_hand_plan_is_predicted_faster(depth, width, heads, world, fraction):
    """Small GPTs, 2 and 4 ranks, budgets from the least any plan needs to what the fastest needs: the plan fits,
    and no uniform plan of the family (data parallel, ZeRO-2, ZeRO-3, Megatron TP), measured at full depth on its
    own, fits the budget with a lower predicted time."""
    model, inputs = gpt(n_layer=depth, n_embd=width, n_head=heads), batch(4)
    mesh = gt.placement("cpu", list(range(world)))
    free = gt.auto_plan(model, inputs, mesh, tensor_plans=TP)
    least = min(c.peak_memory for c in free.candidates)
    budget = least + fraction * (free.chosen.peak_memory - least)
    auto = free.within(budget)
    assert auto.predicted["max"]["peak_memory"] <= budget
    tensor = [c for c in free.candidates if c.axes.tensor is not None]  # heads the ranks do not divide: none
    for hand in [uniform(free, s) for s in ("dp", "zero2", "zero3")] + tensor:
        figs = measure(model, inputs, mesh, free.plan_of(hand), sbp=gt.planning.batch_sbp(hand.axes, 1))
        assert figs == hand.figures  # the hand plan at full depth costs what one block and two predicted
        hand_time = max(step_time(figs.collectives[r], figs.recv_bytes[r], hand.flops) for r in range(world))
        if hand.peak_memory <= budget:
            assert auto.chosen.time <= hand_time


def test_a_model_on_meta_plans_as_the_same_model_with_values():
    """Planning reads shapes only: the GPT built on meta gets the plan, figures and explanation of the one with values,
    and a 32-block model is measured with the runs of a 2-block one (the rest is arithmetic)."""
    inputs = batch(4)
    with torch.device("meta"):
        torch.manual_seed(0)
        meta = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=32, n_head=4, n_embd=16))
    real = gpt(n_layer=32)
    mesh = gt.placement("cpu", [0, 1])
    a, b = gt.auto_plan(meta, inputs, mesh, tensor_plans=TP), gt.auto_plan(real, inputs, mesh, tensor_plans=TP)
    assert a.plan == b.plan and a.predicted == b.predicted
    assert [(c.axes, c.root, c.blocks, c.peak_memory) for c in a.candidates] == [
        (c.axes, c.root, c.blocks, c.peak_memory) for c in b.candidates]
    assert len(a.candidates) == 1 + 561 + 2 * 33  # TP; root dp x every mix of 32 blocks; ZeRO roots x ZeRO mixes
    assert all(p.is_meta for p in meta.parameters())  # unchanged


def test_hf_llama_plans_from_its_own_tensor_plan_exactly_and_trains_as_one_device():
    """A Hugging Face Llama built tiny from its config, on 2x2, with its own TP plan (`gt.hf.tp_plan`, the default):
    the chosen plan and the least-memory one receive, store and save exactly what was predicted in a real step, and
    the chosen one trains as one device (fp64, one AdamW step)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    ranks = [[0, 1], [2, 3]]
    mesh = gt.placement("cpu", ranks)
    auto = gt.auto_plan(model, inputs, mesh)
    assert auto.blocks == "model.layers" and {c.axes.tensor_plan for c in auto.candidates} == {None, "tp"}
    least = min(auto.candidates, key=lambda c: c.peak_memory)
    for c in (auto.chosen, least):
        got = measure(model, inputs, mesh, auto.plan_of(c), sbp=gt.planning.batch_sbp(c.axes, 2), dry=False)
        assert got == c.figures, c

    def train(plan, sbp):
        m = gt.to_global(copy.deepcopy(model), gt.placement("cpu", ranks), plan)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loss = m(**{k: gt.to_global(v, m.lm_head.weight.placement, sbp) for k, v in inputs.items()}).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        opt.step()
        return loss.full_tensor(), grads, {n: p.full_tensor() for n, p in m.named_parameters()}

    one = copy.deepcopy(model)
    opt = torch.optim.AdamW(one.parameters(), lr=1e-2)
    loss = one(**inputs).loss
    loss.backward()
    want = (loss.detach(), {n: p.grad.clone() for n, p in one.named_parameters()})
    opt.step()
    want += ({n: p.detach().clone() for n, p in one.named_parameters()},)
    for got in gt.launch(train, 4, args=(auto.plan, auto.predicted["batch_sbp"])):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
        for g, w in zip(got[1:], want[1:]):
            assert g.keys() == w.keys()
            for n in w:
                torch.testing.assert_close(g[n], w[n], rtol=0, atol=1e-10, msg=n)


def test_moe_gpt_takes_expert_parallelism_predicted_exactly_and_trains_as_one_device():
    """The MoE GPT (8 experts, top-2) on 4 ranks with `ep_plan` offered: the experts split over the data axis
    (EP x DP) beats replicating them (their gradients would be all-reduced); every EP plan of the family, ZeRO blocks
    around the experts included, receives, stores and saves what was predicted, and the choice trains as one
    device (fp64). At n_embd 16 the experts are too small for it: data parallelism, since it moves DDP's all-reduce
    alone (449 kB in 2 collectives, 0.61 ms predicted), beats EP's 102 kB in 10 (0.66 ms); at 32, EP wins."""
    from globaltensor.models.moe import MoEConfig, MoEGPT, ep_plan
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32, n_expert=8,
                             top_k=2)).double()
    inputs = batch(8)
    mesh = gt.placement("cpu", [0, 1, 2, 3])
    auto = gt.auto_plan(model, inputs, mesh, expert_plans={"ep": ep_plan})
    experts = {k: v for k, v in auto.plan.items() if ".experts." in k}
    assert auto.chosen.axes.expert == 0 and experts and set(experts.values()) == {(gt.split(0),)}, auto.explain()
    no_ep = min((c for c in auto.candidates if c.axes.expert is None), key=lambda c: c.time)
    assert auto.chosen.time < no_ep.time and auto.chosen.peak_memory < no_ep.peak_memory
    for c in auto.candidates:
        if c.axes.expert is not None and sum(1 for _, k in c.blocks if k) == 1:  # the uniform EP plans
            got = measure(model, inputs, mesh, auto.plan_of(c), sbp=(gt.split(0),), dry=False)
            assert got == c.figures, c
    want = _one_device(model, inputs)
    for got in gt.launch(_train, 4, args=(model, auto.plan, [0, 1, 2, 3], (gt.split(0),), inputs)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
        for g, w in zip(got[1:], want[1:]):
            for n in w:
                torch.testing.assert_close(g[n], w[n], rtol=0, atol=1e-10, msg=n)


def _tallies(results: list) -> list:
    """Each rank's (received bytes, communications) from dry-run results whose first item is a comm log (a symmetric
    run's ranks share their class's log)."""
    shared: dict = {}
    for rank, r in enumerate(results):
        shared.setdefault(id(r[0]), (r[0], []))[1].append(rank)
    out = {rank: t for log, ranks in shared.values() for rank, t in log.per_rank(ranks).items()}
    return [out[r] for r in range(len(results))]


@pytest.fixture
def symmetric_runs(monkeypatch):
    """The outcome of each symmetric dry run: "ran" or why every rank was run instead."""
    from globaltensor.runtime import symmetry
    outcomes, real = [], symmetry.run

    def run(body, mesh):
        try:
            out = real(body, mesh)
        except symmetry.Asymmetric as e:
            outcomes.append(str(e))
            raise
        outcomes.append("ran")
        return out
    monkeypatch.setattr(symmetry, "run", run)
    return outcomes


def test_symmetric_dry_runs_receive_what_every_rank_does(symmetric_runs):
    """Uneven splits (6 rows over 4 ranks: classes of ranks), an all-gather of them, a transposing conversion whose
    point-to-point messages differ per rank (the diagonal ranks keep their rows), a loss's scalar all-reduce (rank 0
    of a group receives more): one rank per class is run, and every rank's bytes and communications are the all-rank
    run's. A layout on part of the mesh is refused, and the all-rank run answers."""
    from globaltensor.tools.explain import dry_run
    ranks = [[0, 1, 2, 3], [4, 5, 6, 7]]

    def program(part: bool):
        mesh = gt.placement("cpu", ranks)
        x = gt.to_global(torch.empty(6, 8), mesh, (gt.broadcast, gt.split(0)))
        with gt.comm_log() as log:
            y = x.to_global(sbp=(gt.split(0), gt.broadcast))
            z = x.to_global(sbp=(gt.broadcast, gt.broadcast))
            s = (y * 2).sum().to_global(sbp=(gt.broadcast, gt.broadcast))
            if part:
                gt.to_global(torch.empty(4), gt.placement("cpu", [0, 1]), gt.split(0))
        return log, tuple(y.to_local().shape), tuple(z.to_local().shape), tuple(s.to_local().shape)

    mesh = gt.placement("cpu", ranks)
    for part in (False, True):
        every = dry_run(lambda: program(part), 8)
        one = dry_run(lambda: program(part), 8, symmetric=mesh)
        assert _tallies(one) == _tallies(every) and [r[1:] for r in one] == [r[1:] for r in every]
        assert len({b for b, _ in _tallies(every)}) > 2  # the ranks do differ
    assert symmetric_runs[0] == "ran" and "not the whole mesh" in symmetric_runs[1], symmetric_runs
    # 6 rows over axis 1 as 2, 2, 1, 1: two classes of ranks there, one on axis 0 (3, 3): two ranks run
    assert len({id(r[0]) for r in dry_run(lambda: program(False), 8, symmetric=mesh)}) == 2


@pytest.mark.slow  # about 24 CPU-seconds: two all-rank dry runs on 16 ranks
def test_a_4x4_mesh_plans_from_symmetric_runs_as_from_every_rank(symmetric_runs):
    """16 ranks, each candidate's dry runs on one rank: the chosen plan and the TP x ZeRO-3 plan (whose ZeRO
    conversions send rank-specific messages) receive, count, store, save and gather exactly what the all-rank dry
    run of the full-depth model does."""
    model, inputs = gpt(n_layer=2), batch(16)
    mesh = gt.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])
    auto = gt.auto_plan(model, inputs, mesh, tensor_plans=TP)
    assert symmetric_runs == ["ran"] * 9, symmetric_runs
    tp_zero3 = next(c for c in auto.candidates if c.axes.tensor == 1 and c.root == "zero3"
                    and dict(c.blocks)["zero3"] == 2)
    for c in (auto.chosen, tp_zero3):
        sbp = gt.planning.batch_sbp(c.axes, 2)
        assert measure(model, inputs, mesh, auto.plan_of(c), sbp=sbp, symmetric=False) == c.figures, c
