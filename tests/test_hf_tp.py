"""`gt.hf.tp_plan`: a transformers model's own TP plan as our module plan, on 1-D (TP) and 2-D (DP x TP) meshes,
equal to the same model on one device (loss, gradients, parameters after an AdamW step)."""
from __future__ import annotations

import subprocess
import sys
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import globaltensor as gt  # noqa: E402
from globaltensor.hf import generic_name, model_tp_plan  # noqa: E402

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=32)


# Llama; Qwen2 (biased q/k/v: split with their weights); Qwen3 (per-head q/k norms, "replicated_with_grad_allreduce");
# Gemma2 (lm_head tied to the vocab-split embedding, logit soft-capping)
FAMILIES = ["Llama", "Qwen2", "Qwen3", "Gemma2"]


def llama(family: str = "Llama") -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**CFG)
    return getattr(transformers, f"{family}ForCausalLM")(config).double()


def ids() -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(1))


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, gt.GlobalTensor) else t).detach().cpu().clone()


SP = {"model.layers.*.input_layernorm": "sequence_parallel", "model.layers.*.post_attention_layernorm":
      "sequence_parallel", "model.norm": "sequence_parallel"}


def step(mesh: tuple | None, family: str = "Llama", sp: bool = False) -> dict:
    """One forward/backward/AdamW step of `model(input_ids=ids, labels=ids)`, on one device (mesh None) or on
    `mesh` with the model's TP plan on its last axis and the batch split on the first of a 2-D mesh."""
    model, x = llama(family), ids()
    out: dict = {}
    if mesh is not None:
        nd = len(mesh)
        p = gt.placement("cpu", np.arange(int(np.prod(mesh))).reshape(mesh).tolist())
        plan = (model._tp_plan | SP) if sp else None
        gt.to_global(model, p, gt.hf.tp_plan(model, axis=nd - 1, ndim=nd, plan=plan))
        x = gt.to_global(x, p, (gt.split(0), gt.broadcast) if nd == 2 else gt.broadcast)
        q = model.model.layers[0].self_attn.q_proj.weight
        k = model.model.layers[0].self_attn.k_proj.weight
        out["sbp"] = {"q": q.sbp, "k": k.sbp, "o": model.model.layers[0].self_attn.o_proj.weight.sbp,
                      "embed": model.model.embed_tokens.weight.sbp, "lm_head": model.lm_head.weight.sbp}
        out["local"] = {"q": tuple(q.to_local().shape), "k": tuple(k.to_local().shape)}
        gt.reset_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    res = model(input_ids=x, labels=x)
    res.loss.backward()
    out["loss"] = whole(res.loss).item()
    out["logits"] = whole(res.logits)
    out["grads"] = {n: whole(p.grad) for n, p in model.named_parameters()}
    opt.step()
    out["params"] = {n: whole(p) for n, p in model.named_parameters()}
    if mesh is not None:
        out["fallback"] = dict(gt.stats()["fallback"])
    return out


def _assert_equals_one_device(r: dict, reference: dict) -> None:
    """transformers computes the loss in fp32 (ForCausalLMLoss upcasts the logits), so a batch split over DP sums it
    in another order: fp32 agreement; the fp64 logits, gradients and parameters agree to 1e-10."""
    np.testing.assert_allclose(r["loss"], reference["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(r["logits"], reference["logits"], rtol=0, atol=1e-10)
    for name, g in reference["grads"].items():
        torch.testing.assert_close(r["grads"][name], g, rtol=0, atol=1e-10, msg=name)
        torch.testing.assert_close(r["params"][name], reference["params"][name], rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_tp_matches_one_device(mesh, family):
    reference = step(None, family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(step, int(np.prod(mesh)), args=(mesh, family))
    t = (gt.broadcast,) * (len(mesh) - 1)
    for r in results:
        _assert_equals_one_device(r, reference)
        assert r["sbp"] == {"q": t + (gt.split(0),), "k": t + (gt.split(0),), "o": t + (gt.split(1),),
                            "embed": t + (gt.split(0),), "lm_head": t + (gt.split(0),)}
        assert r["local"] == {"q": (16, 32), "k": (8, 32)}  # 4 heads x 8 and 2 kv heads x 8, halved
        assert r["fallback"] == {}


def comm_of_a_step(use_cache: bool) -> tuple[dict, dict]:
    """{(kind, bytes received): count} of one forward and of its backward, TP=2."""
    model = llama()
    p = gt.placement("cpu", [0, 1])
    gt.to_global(model, p, gt.hf.tp_plan(model))
    x = gt.to_global(ids(), p, gt.broadcast)
    with gt.comm_log() as log:
        loss = model(input_ids=x, labels=x, use_cache=use_cache).loss
        n = len(log.events)
        loss.backward()
    count = lambda events: dict(Counter((e.kind, e.recv_bytes) for e in events))  # noqa: E731
    return count(log.events[:n]), count(log.events[n:])


@pytest.mark.parametrize("use_cache", [False, True])
def test_tp_communicates_as_megatron(use_cache):
    """Forward: one all-reduce of [4, 8, 32] fp64 (8 KiB) after the vocab-parallel embedding and each row-parallel
    projection (1 + 2 per layer), one all-gather of the vocab-split logits; backward: one all-reduce of each
    column-parallel block's input gradient, Megatron's f (the attention's, whose q, k and v read it, and the MLP's,
    for gate and up, per layer, and lm_head's), where each of the five projections all-reduced its own until
    `gt.hf.tp_plan` hinted their parent (the attention takes its input by keyword). transformers' KV cache
    (`use_cache=True`, its default) changes nothing: its `torch.cat` of a plain empty 1-D tensor with the key
    split on the heads keeps the split (it made the key Partial, two reduce-scatters per layer, until torch.cat's
    rule learnt that torch skips such a tensor)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fwd, bwd = gt.launch(comm_of_a_step, 2, args=(use_cache,))[0]
    layers = CFG["num_hidden_layers"]
    assert fwd == {("all_reduce", 8192): 1 + 2 * layers, ("all_gather", 8192): 1}
    assert bwd == {("all_reduce", 8192): 2 * layers + 1}


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_sequence_parallel_norms_match_one_device(mesh):
    """transformers' "sequence_parallel" on the norms (their input split on the sequence) with the shipped plan."""
    reference = step(None)
    plan = gt.hf.tp_plan(llama(), plan=llama()._tp_plan | SP)
    assert plan["model.layers.*.input_layernorm"] == gt.ModuleLayout(input=(gt.split(1),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(step, int(np.prod(mesh)), args=(mesh, "Llama", True))
    for r in results:
        _assert_equals_one_device(r, reference)
        assert r["fallback"] == {}


def test_plan_from_llama():
    model = llama()
    assert model_tp_plan(model) == model._tp_plan
    plan = gt.hf.tp_plan(model, axis=1, ndim=2)
    B, S0, S1 = gt.broadcast, gt.split(0), gt.split(1)
    assert plan["model.layers.*.self_attn.q_proj.weight"] == (B, S0)
    assert plan["model.layers.*.mlp.down_proj.weight"] == (B, S1)
    assert plan["model.embed_tokens.weight"] == (B, S0)
    assert plan["lm_head.weight"] == (B, S0)
    assert "model.layers.*.self_attn.q_proj.bias" not in plan  # Llama's projections have no bias
    # q, k and v read the attention's input: its gradient all-reduced once there (Megatron's f), not at each
    assert "model.layers.*.self_attn.q_proj" not in plan
    assert plan["model.layers.*.self_attn"] == gt.ModuleLayout(input_grad=(None, B))
    assert plan["model.layers.*.mlp"] == gt.ModuleLayout(input_grad=(None, B))  # gate and up
    assert plan["model.layers.*.self_attn.o_proj"] == gt.ModuleLayout(output=(None, B))
    assert plan["lm_head"] == gt.ModuleLayout(input_grad=(None, B), output=(None, B))  # colwise_gather_output
    assert plan["model.embed_tokens"] == gt.ModuleLayout(output=(None, B))
    one = gt.hf.tp_plan(model)
    assert one["model.layers.*.self_attn.q_proj.weight"] == (S0,)
    assert one["model.layers.*.self_attn.o_proj"] == gt.ModuleLayout(output=(B,))


def test_base_model_plan_is_prefixed_when_no_tp_plan():
    model = llama()
    model._tp_plan = {}
    plan = model_tp_plan(model)
    assert plan == {"model." + k: v for k, v in model.config.base_model_tp_plan.items()}
    assert gt.hf.tp_plan(model)["model.layers.*.mlp.up_proj.weight"] == (gt.split(0),)


def test_styles_with_bias_and_rowwise_variants():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG, attention_bias=True))
    plan = gt.hf.tp_plan(model, plan={"model.layers.*.self_attn.q_proj": "colwise_rep",
                                      "model.layers.*.self_attn.o_proj": "rowwise_split_input",
                                      "model.embed_tokens": "embedding_colwise",
                                      "model.norm": "replicated_with_grad_allreduce"})
    assert plan["model.layers.*.self_attn.q_proj.bias"] == (gt.split(0),)
    assert plan["model.layers.*.self_attn.q_proj"] == gt.ModuleLayout(input_grad=(gt.broadcast,),
                                                                      output=(gt.broadcast,))
    assert "model.layers.*.self_attn.o_proj.bias" not in plan  # a row-parallel bias is whole (Broadcast)
    assert plan["model.layers.*.self_attn.o_proj"] == gt.ModuleLayout(output=(gt.broadcast,))
    assert plan["model.embed_tokens.weight"] == (gt.split(1),)
    assert not any(k.startswith("model.norm") for k in plan)


@pytest.mark.parametrize("style", ["moe_identity_expert", "all_reduce", "local_colwise", "grouped_gemm",
                                   "no_such_style"])
def test_unmapped_styles_are_named(style):
    with pytest.raises(NotImplementedError, match=f"{style}.*model.layers.\\*.mlp.gate_proj"):
        gt.hf.tp_plan(llama(), plan={"model.layers.*.mlp.gate_proj": style})


def test_expert_styles_split_the_experts_weights_and_reduce_at_the_experts_boundary():
    """Mixtral's plan names the experts' 3-D weights as parameters: gate_up_proj [E, 2I, H] "packed_colwise" splits
    dim 1 strided in two groups (each rank its slice of gate and of up: `chunk` moves nothing), down_proj
    [E, H, I] "rowwise" dim 2;
    the experts module takes its input whole, and all-reduces its output, its input's gradient and the routing
    weights' (its third argument) on the tensor axis (on the data axis its output's rows go back to the tokens'
    cut)."""
    config = transformers.MixtralConfig(**CFG, num_local_experts=4, num_experts_per_tok=2)
    plan = gt.hf.tp_plan(transformers.MixtralForCausalLM(config), axis=1, ndim=2)
    for i in range(2):
        assert plan[f"model.layers.{i}.mlp.experts.gate_up_proj"] == (gt.broadcast, gt.strided(1, 2))
        assert plan[f"model.layers.{i}.mlp.experts.down_proj"] == (gt.broadcast, gt.split(2))
    B = (None, gt.broadcast)
    assert plan["model.layers.*.mlp.experts"] == gt.ModuleLayout(input=B, input_grad=B, arg_grads={2: B},
                                                                  output=(gt.ragged(0), gt.broadcast))
    with pytest.raises(NotImplementedError, match="'grouped_gemm' of parameter pattern 'model.layers.*.mlp.experts"):
        gt.hf.tp_plan(transformers.MixtralForCausalLM(config), plan={"model.layers.*.mlp.experts.down_proj":
                                                                     "grouped_gemm"})


def test_pattern_conversion():
    assert generic_name("model.layers.12.self_attn.q_proj") == "model.layers.*.self_attn.q_proj"
    assert generic_name("model.layers.0") == "model.layers.*"
    assert generic_name("mlp.w1") == "mlp.w1"  # numbers inside a name are not layer numbers
    model = llama()
    # keys naming no module are skipped, as transformers skips them
    assert gt.hf.tp_plan(model, plan={"model.nothing.*.here": "colwise", "lm_head": "colwise"}) == \
        {"lm_head.weight": (gt.split(0),), "lm_head": gt.ModuleLayout(input_grad=(gt.broadcast,))}
    # a glob that fnmatch reads wider than transformers does ("*" crossing dots) becomes the modules' names
    wide = gt.hf.tp_plan(model, plan={"model.layers.*": "gather"})
    assert wide == {f"model.layers.{i}": gt.ModuleLayout(output=(gt.broadcast,)) for i in range(2)}
    with pytest.raises(ValueError, match="axis"):
        gt.hf.tp_plan(model, axis=2, ndim=2)


def test_importing_globaltensor_does_not_import_transformers():
    code = "import sys, globaltensor; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
