"""Expert parallelism for Hugging Face MoE models from their own plan (`gt.hf.ep_plan`, issue 36).

transformers' MoE configs ship `base_model_ep_plan` (Mixtral, Qwen2-MoE, DeepSeek-V3: the experts' weights
"grouped_gemm", the experts module "ep_dispatch_experts"). `gt.hf.ep_plan` makes it our plan: the weights split
by expert, the experts module declared expert-local (`ModuleLayout(expert_local=True)`,
`globaltensor/parallel/experts.py`), so each routed row goes to its expert's rank and back, one all-to-all each
way (`by_expert` / `by_group`, our dropless MoE's), and the module's own forward (transformers' grouped GEMM in
fp32, its eager loop in fp64) runs on each rank's rows with its experts. Everything else is data parallel.

Each case takes one AdamW step (three for one) equal to one device's (loss, every gradient, every parameter),
with no fallback, and its bytes counted exactly: `hf_zoo.textbook_ep` (the dispatch and combine all-to-alls of
the routed rows forward and backward, read off one device's routing choices; DDP's all-reduce of the
non-expert gradients over all ranks and of the expert shards over the data axis; the count exchange as an
all-to-all of E/e counts per peer) plus two excesses, each derived:

- the count exchange is an all-gather of each rank's [1, E] counts over the e ranks of the expert axis
  (`by_expert`: the ragged result carries every rank's size, which needs every column), (e-1) * E int64 per
  experts call where the textbook's all-to-all takes (e-1) * E/e: (e-1) * E * (1 - 1/e) * 8 bytes more a call;
- the loss: one fp32 scalar all-reduced (a tiny all-reduce moves each peer's value: (n-1) * 4 bytes on a
  1-D mesh of n, 4 bytes per axis on the 2x2 mesh);
- on the 2x2 mesh, the gradient bucket's 2-D all-reduce (a reduce-scatter over one axis, an all-reduce of the
  shard over the other, an all-gather) cuts each gradient on its dim 0: a gradient of one row (Qwen2-MoE's
  shared_expert_gate, [1, 32]) is rank 0's whole, which receives its other half in the reduce-scatter (+n/2
  elements) and reduces all of it over the other axis (+n/2), and receives nothing of it in the all-gather
  (-n/2): n/2 elements more per such gradient of n.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import globaltensor as gt  # noqa: E402
import hf_zoo  # noqa: E402
from test_hf_zoo import _close, _equal_one_device  # noqa: E402

# (architecture, strategy, world): EP on 2 and 4 ranks, EP x DP on 2x2 (data, expert)
CASES = [("mixtral", "ep", 2), ("mixtral", "ep", 4), ("mixtral", "dp_ep", 4),
         ("mixtral_eager", "ep", 2), ("mixtral_eager", "dp_ep", 4),
         ("qwen2_moe", "ep", 2), ("qwen2_moe", "ep", 4), ("qwen2_moe", "dp_ep", 4), ("deepseek_v3", "ep", 4)]


@functools.lru_cache(maxsize=None)
def one_device(name: str, steps: int) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_zoo.step(hf_zoo.ZOO[name], steps=steps, routes=True)


def expected_bytes(got: dict, name: str, strategy: str, world: int, steps: int) -> tuple[int, dict]:
    """The textbook's bytes plus the two excesses of the module docstring, exactly."""
    data = 2 if strategy == "dp_ep" else 1
    e = world // data
    routes = one_device(name, steps)["routes"]
    book = hf_zoo.textbook_ep(got["ep_sizes"], routes, world, data, steps)
    n_expert = got["ep_sizes"]["n_expert"]
    counts = len(routes) * (e - 1) * (n_expert - n_expert // e) * 8
    loss = steps * (8 if data > 1 else (world - 1) * 4)
    one_row = steps * got["ep_sizes"]["one_row"] // 2 * got["ep_sizes"]["size"] if data > 1 else 0
    return int(book["total"]) + counts + loss + one_row, book


@pytest.mark.parametrize("name,strategy,world", CASES)
def test_ep_from_the_models_plan_equals_one_device(name: str, strategy: str, world: int) -> None:
    got = hf_zoo.step(hf_zoo.ZOO[name], strategy, world)
    _equal_one_device(name, got)
    assert not got["fallback"], got["fallback"]
    want, book = expected_bytes(got, name, strategy, world, 1)
    assert got["recv_bytes"] == want, (got["recv_bytes"], want, book, got["events"])


def test_ep_three_steps_end_to_end() -> None:
    """Mixtral with transformers' eager experts in fp64, EP x DP on 2x2, three AdamW steps: every step's loss, the
    last step's gradients and the parameters after it as on one device; the bytes the textbook's over the three
    steps' own routing (which the steps change) plus the excesses."""
    name = "mixtral_eager"
    want = one_device(name, 3)
    got = hf_zoo.step(hf_zoo.ZOO[name], "dp_ep", 4, steps=3)
    for g, w in zip(got["losses"], want["losses"]):
        assert abs(g - w) <= 2e-6 * max(1.0, abs(w)), (got["losses"], want["losses"])
    fp32 = hf_zoo.ZOO[name].fp32_inside
    for n, w in want["grads"].items():
        assert (got["grads"][n] is None) == (w is None)
        if w is not None:
            _close(got["grads"][n], w, f"grad {n}", fp32)
    for n, w in want["params"].items():
        torch.testing.assert_close(got["params"][n], w, rtol=1e-5, atol=1e-5, msg=lambda m: f"param {n}: {m}")
    assert not got["fallback"], got["fallback"]
    expected, book = expected_bytes(got, name, "dp_ep", 4, 3)
    assert got["recv_bytes"] == expected, (got["recv_bytes"], expected, book)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_ep_composes_with_the_models_tp_plan(name: str) -> None:
    """EP x TP on 2x2 (expert, tensor): `gt.hf.ep_plan(tp_axis=1)` adds the model's TP plan on the tensor axis
    without its entries for the experts (transformers' rule: EP's win), so attention is Megatron's and the experts
    run expert-parallel (whole on the tensor axis); one AdamW step equals one device's with no fallback. (Its
    bytes are not yet counted against a textbook here: each tensor rank dispatches the same rows, where
    transformers slices them over the tensor group.)"""
    got = hf_zoo.step(hf_zoo.ZOO[name], "ep_tp", 4)
    _equal_one_device(name, got)
    assert not got["fallback"], got["fallback"]
    plan = gt.hf.ep_plan(hf_zoo.ZOO[name].build(), axis=0, ndim=2, tp_axis=1)
    assert plan["model.layers.*.mlp.experts"] == gt.ModuleLayout(expert_local=True)
    assert plan["model.layers.*.self_attn.q_proj.weight"] == (gt.broadcast, gt.split(0))
    experts = {k: v for k, v in plan.items() if gt.hf.generic_name(k).startswith("model.layers.*.mlp.experts")}
    assert experts == {"model.layers.*.mlp.experts": gt.ModuleLayout(expert_local=True),
                       "model.layers.*.mlp.experts.gate_up_proj": (gt.split(0), gt.broadcast),
                       "model.layers.*.mlp.experts.down_proj": (gt.split(0), gt.broadcast)}, experts


def test_ep_plan_maps_the_models_plan() -> None:
    """The entries: the experts' weights split on dim 0 over the EP axis (Broadcast on the others), the experts
    module expert-local; the keys under the base model's prefix, as transformers' `model.ep_plan` has them."""
    model = hf_zoo.ZOO["mixtral"].build()
    assert gt.hf.model_ep_plan(model) == {f"model.{k}": v for k, v in model.config.base_model_ep_plan.items()}
    plan = gt.hf.ep_plan(model, axis=1, ndim=2)
    assert plan == {"model.layers.*.mlp.experts.gate_up_proj": (gt.broadcast, gt.split(0)),
                    "model.layers.*.mlp.experts.down_proj": (gt.broadcast, gt.split(0)),
                    "model.layers.*.mlp.experts": gt.ModuleLayout(expert_local=True)}
    with pytest.raises(ValueError, match=r"ep_plan\(axis=2\)"):
        gt.hf.ep_plan(model, axis=2, ndim=2)
    with pytest.raises(ValueError, match=r"ep_plan\(tp_axis=1\).*other than the expert axis 1"):
        gt.hf.ep_plan(model, axis=1, ndim=2, tp_axis=1)
    with pytest.raises(NotImplementedError, match=r"'colwise'.*gt.hf.tp_plan"):
        gt.hf.ep_plan(model, plan={"model.layers.*.self_attn.q_proj": "colwise"})
    with pytest.raises(ValueError, match="ships no expert-parallel plan"):
        gt.hf.ep_plan(hf_zoo.ZOO["llama"].build())
    with pytest.raises(NotImplementedError, match=r"'ep_dispatch_experts'.*gt.hf.ep_plan"):
        gt.hf.tp_plan(model, plan={"model.layers.*.mlp.experts": "ep_dispatch_experts"})


def test_expert_local_refuses_what_it_cannot_run() -> None:
    """An expert-local module whose weights are not split by expert (whole: there is nothing to dispatch to), and
    a declaration that is both row- and expert-local, are refused by name."""
    with pytest.raises(ValueError, match="row_local=True, expert_local=True"):
        gt.ModuleLayout(row_local=True, expert_local=True)
    with pytest.raises(TypeError, match="expert_local"):
        gt.ModuleLayout(expert_local=1)

    def body() -> None:
        model, batch = hf_zoo.ZOO["mixtral"].build(), hf_zoo.ZOO["mixtral"].batch()
        p = gt.placement("cpu", [0, 1])
        gt.to_global(model, p, {"model.layers.*.mlp.experts": gt.ModuleLayout(expert_local=True)})
        with pytest.raises(ValueError, match=r"expert_local: a parameter .* split on dim 0"):
            model(**{k: gt.to_global(v, p, gt.split(0)) for k, v in batch.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gt.launch(body, 2)
