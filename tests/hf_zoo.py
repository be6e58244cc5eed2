"""The Hugging Face model zoo, built tiny from configs (never downloaded), for tests/test_hf_zoo.py (issue 36).

Each `Arch` names a transformers config and model class, what inputs the model takes and how its
config is made tiny. `step(arch, strategy)` runs one forward, backward and AdamW step as a user
would (keyword inputs, the model's own loss), on one device (strategy None) or on simulated ranks
under a strategy, and returns what a test compares: loss, output type, gradients and parameters
after the step (whole), the fallbacks and the bytes received.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

import globaltensor as gt
from globaltensor.runtime.comm import all_reduce_recv_bytes

transformers: Any = None  # imported on first use: collecting the tests must not need it

TINY = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=48, max_position_embeddings=64, head_dim=8, d_model=32, d_ff=48, num_layers=2,
    num_decoder_layers=2, num_heads=4, d_kv=8, n_embd=32, n_layer=2, n_head=4, n_positions=64, n_ctx=64,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
    decoder_ffn_dim=48, image_size=32, patch_size=8, num_channels=3, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, n_routed_experts=4,
    n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0, first_k_dense_replace=1, n_group=1,
    topk_group=1, type_vocab_size=2, embedding_size=32, num_labels=3, num_mel_bins=16, max_source_positions=16,
    max_target_positions=32, state_size=8, expand=2, conv_kernel=4, time_step_rank=4, hidden_sizes=[8, 16],
    depths=[1, 1],
)
BATCH, SEQ = 8, 32


@dataclasses.dataclass(frozen=True)
class Arch:
    config: str                      # transformers config class name
    model: str                       # model class name
    inputs: str                      # "lm" (causal LM), "mlm", "seq2seq", "image", "audio"
    extra: tuple = ()                # (attribute, value) set on the config after TINY
    dtype: torch.dtype = torch.float64  # float32 where a kernel has no fp64 (MoE's grouped_mm)
    fp32_inside: bool = False        # computes part of its forward in fp32 whatever its dtype (Llama 4's rotary)
    # modules that compute each token from its own row alone (a dropless MoE block): declared row-local in the
    # data-parallel plans, so they run on each rank's tokens as DDP runs them, not as the global sort they write
    row_local: tuple = ()

    def build(self) -> nn.Module:
        global transformers
        if transformers is None:
            import transformers as _t
            transformers = _t
        cfg = getattr(transformers, self.config)()
        for k, v in TINY.items():
            if hasattr(cfg, k):
                try:
                    setattr(cfg, k, v)
                except AttributeError:  # a derived property (Falcon's head_dim)
                    pass
        for k, v in self.extra:
            setattr(cfg, k, v)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return getattr(transformers, self.model)(cfg).to(self.dtype).train()

    def batch(self) -> dict:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, TINY["vocab_size"], (BATCH, SEQ), generator=g)
        if self.inputs == "lm":
            return dict(input_ids=ids, labels=ids)
        if self.inputs == "mlm":
            return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        if self.inputs == "seq2seq":
            return dict(input_ids=ids, labels=torch.randint(3, TINY["vocab_size"], (BATCH, 6), generator=g))
        if self.inputs == "image":
            return dict(pixel_values=torch.randn(BATCH, 3, 32, 32, generator=g, dtype=self.dtype),
                        labels=torch.randint(0, TINY["num_labels"], (BATCH,), generator=g))
        if self.inputs == "audio":
            return dict(input_features=torch.randn(BATCH, TINY["num_mel_bins"], 2 * TINY["max_source_positions"],
                                                   generator=g, dtype=self.dtype),
                        labels=torch.randint(3, TINY["vocab_size"], (BATCH, 6), generator=g))
        raise ValueError(self.inputs)


ZOO = {
    # decoders
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "lm"),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", "lm"),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", "lm"),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", "lm"),
    "gemma": Arch("GemmaConfig", "GemmaForCausalLM", "lm"),
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", "lm"),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", "lm"),
    "phi": Arch("PhiConfig", "PhiForCausalLM", "lm"),
    "olmo2": Arch("Olmo2Config", "Olmo2ForCausalLM", "lm", fp32_inside=True),  # its norms upcast to fp32
    "starcoder2": Arch("Starcoder2Config", "Starcoder2ForCausalLM", "lm"),
    "stablelm": Arch("StableLmConfig", "StableLmForCausalLM", "lm"),
    "cohere": Arch("CohereConfig", "CohereForCausalLM", "lm"),
    "granite": Arch("GraniteConfig", "GraniteForCausalLM", "lm"),
    "gpt2": Arch("GPT2Config", "GPT2LMHeadModel", "lm"),
    "gpt_neox": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", "lm"),
    "gptj": Arch("GPTJConfig", "GPTJForCausalLM", "lm", (("rotary_dim", 4),)),
    "opt": Arch("OPTConfig", "OPTForCausalLM", "lm", (("ffn_dim", 48), ("word_embed_proj_dim", 32))),
    "bloom": Arch("BloomConfig", "BloomForCausalLM", "lm"),
    "falcon": Arch("FalconConfig", "FalconForCausalLM", "lm", (("vocab_size", 64),)),
    "llama4": Arch("Llama4TextConfig", "Llama4ForCausalLM", "lm", (("intermediate_size_mlp", 48),),
                   fp32_inside=True, row_local=("model.layers.*.feed_forward",)),
    "mamba": Arch("MambaConfig", "MambaForCausalLM", "lm"),
    # mixtures of experts
    "mixtral": Arch("MixtralConfig", "MixtralForCausalLM", "lm", dtype=torch.float32, row_local=("model.layers.*.mlp",)),
    # the same in fp64 with transformers' "eager" experts (a loop over the experts hit; grouped_mm has no fp64)
    "mixtral_eager": Arch("MixtralConfig", "MixtralForCausalLM", "lm", (("_experts_implementation", "eager"),),
                          fp32_inside=True, row_local=("model.layers.*.mlp",)),
    "qwen2_moe": Arch("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "lm", dtype=torch.float32, row_local=("model.layers.*.mlp",)),
    "deepseek_v2": Arch("DeepseekV2Config", "DeepseekV2ForCausalLM", "lm", (("num_key_value_heads", 4),),
                        dtype=torch.float32, row_local=("model.layers.*.mlp",)),
    "deepseek_v3": Arch("DeepseekV3Config", "DeepseekV3ForCausalLM", "lm", (("num_key_value_heads", 4),),
                        dtype=torch.float32, row_local=("model.layers.*.mlp",)),
    # encoders
    "bert": Arch("BertConfig", "BertForMaskedLM", "mlm"),
    "roberta": Arch("RobertaConfig", "RobertaForMaskedLM", "mlm"),
    "distilbert": Arch("DistilBertConfig", "DistilBertForMaskedLM", "mlm", (("dim", 32), ("hidden_dim", 48),
                                                                              ("n_layers", 2))),
    "electra": Arch("ElectraConfig", "ElectraForMaskedLM", "mlm"),
    "albert": Arch("AlbertConfig", "AlbertForMaskedLM", "mlm"),
    "deberta_v2": Arch("DebertaV2Config", "DebertaV2ForMaskedLM", "mlm"),
    "roformer": Arch("RoFormerConfig", "RoFormerForMaskedLM", "mlm"),
    # encoder-decoders
    "t5": Arch("T5Config", "T5ForConditionalGeneration", "seq2seq", (("decoder_start_token_id", 0),)),
    "mt5": Arch("MT5Config", "MT5ForConditionalGeneration", "seq2seq"),
    "bart": Arch("BartConfig", "BartForConditionalGeneration", "seq2seq"),
    "pegasus": Arch("PegasusConfig", "PegasusForConditionalGeneration", "seq2seq"),
    "marian": Arch("MarianConfig", "MarianMTModel", "seq2seq", (("decoder_vocab_size", 64),)),
    # vision
    "vit": Arch("ViTConfig", "ViTForImageClassification", "image"),
    "dinov2": Arch("Dinov2Config", "Dinov2ForImageClassification", "image"),
    "convnext": Arch("ConvNextConfig", "ConvNextForImageClassification", "image"),
    "resnet": Arch("ResNetConfig", "ResNetForImageClassification", "image", (("embedding_size", 8),)),
    # audio
    "whisper": Arch("WhisperConfig", "WhisperForConditionalGeneration", "audio"),
}


# decoders whose transformers class ships no TP plan, no pipeline plan
NO_TP_PLAN = {"gpt2", "opt", "bloom", "falcon", "mamba", "stablelm"}
NO_PP_PLAN = {"gpt2", "opt", "bloom", "falcon", "mamba", "stablelm", "llama4"}
# models without a pp plan, cut by naming their repeated layers (gt.hf.pp_plan(layers=))
PP_LAYERS = {"vit": "vit.layers", "convnext": "convnext.encoder.stages"}


def _whole(t: Any) -> Any:
    if isinstance(t, gt.GlobalTensor):
        t = t.full_tensor()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def block_patterns(model: nn.Module) -> list[str]:
    """The repeated blocks of a model: the children of every nn.ModuleList, as `path.*` (ZeRO-3's units)."""
    return sorted({f"{name}.*" for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)})


def has_tp_plan(model: nn.Module) -> bool:
    return bool(gt.hf.model_tp_plan(model))


def mesh_for(strategy: str, world: int) -> list:
    """Ranks of the placement: 1-D, or (data, tensor) for "dp_tp", (data, expert) for "dp_ep", (expert, tensor) for
    "ep_tp"."""
    ranks = list(range(world))
    return [ranks[:world // 2], ranks[world // 2:]] if strategy in ("dp_tp", "zero3_tp", "dp_ep", "ep_tp") else ranks


def batch_sbp(strategy: str) -> Any:
    """The batch's layout: split over every axis but a tensor axis (under EP each rank routes its own tokens)."""
    return {"tp": gt.broadcast, "dp_tp": (gt.split(0), gt.broadcast), "zero3_tp": (gt.split(0), gt.broadcast),
            "ep_tp": (gt.split(0), gt.broadcast),
            "dp_ep": (gt.split(0), gt.split(0))}.get(strategy, gt.split(0))


def plan_for(strategy: str, model: nn.Module, row_local: tuple = (), mesh: Optional[gt.Placement] = None) -> dict:
    rows = {p: gt.ModuleLayout(row_local=True) for p in row_local}
    if strategy == "zero3_tp":  # FSDP x TP: ZeRO-3 on the data axis over the model's own plan on the tensor axis
        return gt.zero_plan(model, mesh, 0, {**gt.hf.tp_plan(model, axis=1, ndim=2), **rows})
    if strategy == "dp":
        return rows
    if strategy == "tp":
        return gt.hf.tp_plan(model)
    if strategy == "dp_tp":  # a row-local MoE block runs on each data rank's tokens, TP over its tensor group
        return {**gt.hf.tp_plan(model, axis=1, ndim=2), **rows}
    if strategy == "ep":  # the experts from the model's own EP plan; the rest data parallel (the MoE block not
        return gt.hf.ep_plan(model)  # row-local: its experts are split, and the plan runs them as EP)
    if strategy == "dp_ep":
        return gt.hf.ep_plan(model, axis=1, ndim=2)
    if strategy == "ep_tp":
        return gt.hf.ep_plan(model, axis=0, ndim=2, tp_axis=1)
    if strategy == "zero3":
        whole = gt.ModuleLayout(params=gt.broadcast)
        return {"*": gt.split(0), "": whole, **{p: whole for p in block_patterns(model)}, **rows}
    raise ValueError(strategy)


def textbook(model: nn.Module, strategy: str, world: int) -> float:
    """Bytes this rank receives in a step by the textbook: DDP's ring all-reduce of the gradients,
    2Ψ(n-1)/n; ZeRO-3's all-gather of each parameter before the forward and again before the backward
    and reduce-scatter of its gradient: 2(N - s) + (n-1)s for a parameter of N elements of which this
    rank stores s (an uneven split makes the ranks differ; an even one gives 3Ψ(n-1)/n), and for a
    frozen parameter the two all-gathers only.

    A model with batch norm adds SyncBatchNorm's statistics, which DDP needs to compute the one-device
    program (per-rank statistics are another): per layer of C channels, the forward's all-gather of each
    rank's mean, invstd and count ((n-1)(2C+1) elements) and the backward's all-reduce of 2C sums."""
    total = 0.0
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            c, size = mod.num_features, mod.running_mean.element_size()
            total += ((world - 1) * (2 * c + 1) * size + all_reduce_recv_bytes(2 * c, size, world, 0))
    for q in model.parameters():
        size = q.element_size()
        if strategy == "dp":
            total += 2 * q.numel() * (world - 1) / world * size if q.requires_grad else 0
        else:
            n, s = q.numel(), q.to_local().numel()
            total += (2 * (n - s) + ((world - 1) * s if q.requires_grad else 0)) * size
    return total


def arch_name(arch: Arch) -> Optional[str]:
    return next((n for n, a in ZOO.items() if a is arch), None)


def activations(arch: Arch) -> dict[str, tuple[int, int]]:
    """{module name: (elements of its first input, of its output)} over the whole batch, from one forward on one
    device: the sizes of the activations a textbook count moves (a ViT's tokens are its patches and class token, a
    ConvNeXt's its pixels, which the config alone does not say)."""
    model, batch = arch.build(), arch.batch()
    sizes: dict = {}

    def hook(name: str) -> Callable:
        def note(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            first = args[0] if args else next(iter(kwargs.values()), None)
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor):
                sizes.setdefault(name, (first.numel(), out.numel()))
        return note
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(hook(name), with_kwargs=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(**batch)
    return sizes


def textbook_dp_tp(model: nn.Module, world: int, acts: dict, zero: bool = False) -> Optional[float]:
    """Bytes this rank of the (2, world/2) data x tensor mesh receives in a step by the textbook (Megatron's TP,
    DDP on the data axis): the data axis' all-reduce of each gradient shard this rank holds, 2(d-1)/d of it, and
    on the tensor axis (t ranks) 2(t-1)/t of each all-reduced activation, this data rank's half of the batch's
    (`acts`, from `activations`): a row-parallel module's (and a vocab-parallel embedding's) output in the forward,
    a column-parallel block's input gradient in the backward (Megatron's f: once for the column-parallel children
    of one module, an attention's q, k and v, an MLP's gate and up, which read its input), and (t-1)/t of a
    gathered column-parallel output ("colwise_rep") in the forward. None where the plan has a style this count does
    not know. `zero`: ZeRO-3 on the data axis (`gt.zero_plan` over the plan) instead of DDP: each parameter's
    tensor-axis shard of N elements, of which this rank stores s, all-gathered for the forward and again for the
    backward (N - s each) and its gradient reduce-scattered ((d-1)s), as `textbook`'s ZeRO-3."""
    d, t = 2, world // 2
    size = next(model.parameters()).element_size()
    if zero:
        total = 0.0
        for q in model.parameters():
            whole = gt.Layout(q.placement, (gt.broadcast,) + tuple(q.sbp[1:])).local_shape(tuple(q.shape), gt.rank())
            n, s = math.prod(whole), q.to_local().numel()
            total += (2 * (n - s) + ((d - 1) * s if q.requires_grad else 0)) * q.element_size()
    else:
        total = sum(2 * (d - 1) / d * q.to_local().numel() * q.element_size()
                    for q in model.parameters() if q.requires_grad)
    modules = dict(model.named_modules())
    blocks: set = set()  # the modules whose column-parallel children's input gradient is counted
    for key, style in gt.hf.model_tp_plan(model).items():
        for name in modules:
            if gt.hf.generic_name(name) != key:
                continue
            if name not in acts:
                return None  # a planned module that took or gave no single tensor: not this count's
            x, y = (n / d * size for n in acts[name])
            if style.startswith("colwise"):
                if name.rpartition(".")[0] in blocks:
                    x = 0  # a sibling's: its block's input gradient is counted once
                blocks.add(name.rpartition(".")[0])
            if style == "colwise":
                total += 2 * (t - 1) / t * x
            elif style in ("colwise_rep", "colwise_gather_output"):
                total += 2 * (t - 1) / t * x + (t - 1) / t * y
            elif style in ("rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
                total += 2 * (t - 1) / t * y
            else:
                return None
    return total


def textbook_pp(model: nn.Module, layers: str, acts: dict, microbatches: int) -> float:
    """Bytes the last of two stages receives in a step by the textbook: the output of the first stage's last layer
    (of the nn.ModuleList `layers`, cut in halves), every micro-batch's, and for a rotary model the position
    embeddings' cos and sin that the first stage computed, [1, seq, head_dim] each per micro-batch (`acts`, from
    `activations`: the whole batch's sizes, the rotary module's output per example). The first stage receives the
    activation's gradient, as many bytes less the cos and sin."""
    size = next(model.parameters()).element_size()
    n = len(dict(model.named_modules())[layers])
    total = acts[f"{layers}.{n // 2 - 1}"][1] * size
    total += sum(microbatches * 2 * y * size for name, (_, y) in acts.items() if name.endswith("rotary_emb"))
    return total


def textbook_ep(sizes: dict, routes: list, world: int, data: int = 1, steps: int = 1) -> dict:
    """Bytes rank 0 receives in `steps` training steps whose routing choices `routes` lists (each experts module's
    top_k_index [T, k] per forward, from one device: `step(routes=True)`) under expert parallelism over e = world /
    data ranks (EP x DP on a (data, e) mesh when data > 1), by the textbook (DeepSpeed-MoE's, Megatron's,
    transformers' `AllToAllEP`): the batch cut into `world` blocks of tokens (rank r holds block r, row-major
    over the mesh), the E experts into e contiguous runs (expert x on expert-axis rank x // (E/e)). Per experts
    call, rank 0 (data rank 0, expert rank 0) receives:
    - the count exchange: an all-to-all of each peer's rows per expert of this rank's, (e-1) * E/e int64;
    - the dispatch: the routed rows of its expert peers' tokens that chose its experts, d elements each;
    - the combine: the results of its own tokens' choices of other ranks' experts, d elements each;
    - in the backward the duals, as many rows again (no counts).
    And DDP's ring all-reduce of the gradients, once per step: 2(w-1)/w of the non-expert ones over all w ranks
    (each holds them whole), 2(data-1)/data of this rank's experts' shard over the data axis.
    Returns {"counts", "rows", "ddp", "total"} in bytes (`sizes`: `ep_sizes` of the global model)."""
    e, size, n_expert = world // data, sizes["size"], sizes["n_expert"]
    counts = rows = 0
    for idx in routes:
        owner = idx // (n_expert // e)                          # expert-axis rank of each choice's expert
        peers = owner[:idx.shape[0] // data].reshape(e, idx.shape[0] // world, -1)  # data rank 0's, by expert rank
        rows += int((peers[1:] == 0).sum()) + int((peers[0] != 0).sum())
        counts += (e - 1) * (n_expert // e)
    ddp = steps * (2 * (world - 1) / world * sizes["dense"] + 2 * (data - 1) / data * sizes["expert"]) * size
    out = {"counts": counts * 8, "rows": 2 * rows * sizes["hidden"] * size, "ddp": ddp}
    out["total"] = sum(out.values())
    return out


def ep_sizes(model: nn.Module) -> dict:
    """What `textbook_ep` reads off a model under `gt.hf.ep_plan`: its non-expert gradient elements (whole on
    every rank), this rank's experts' (split by expert), the experts' count E, the hidden size, the dtype's bytes."""
    def expert(q: Any) -> bool:
        return isinstance(q, gt.GlobalTensor) and any(s == gt.split(0) for s in q.sbp)
    trained = [q for q in model.parameters() if q.requires_grad]
    return {"dense": sum(q.numel() for q in trained if not expert(q)),
            "one_row": sum(q.numel() for q in trained if not expert(q) and q.shape[0] == 1),
            "expert": sum(q.to_local().numel() for q in trained if expert(q)),
            "n_expert": next(q.shape[0] for q in trained if expert(q)), "hidden": model.config.hidden_size,
            "size": trained[0].element_size()}


def step(arch: Arch, strategy: Optional[str] = None, world: int = 4, steps: int = 1, microbatches: int = 1,
         routes: bool = False) -> dict:
    """`steps` training steps (the gradients and loss of the last, the parameters after it); on one device when
    `strategy` is None. "pp": `gt.hf.pp_plan` on `world` one-rank stages, `gt.Pipeline` of 1F1B over 2
    micro-batches; each parameter's gradient and value from the rank holding it. `microbatches` (one device):
    the batch cut as the pipeline cuts it (`tensor_split`), each piece's loss weighted by its share and its
    gradients accumulated in order, as the pipeline's stages sum them: the same sums in the same order."""
    acts = activations(arch) if strategy in ("dp_tp", "zero3_tp", "pp") else {}
    layers = PP_LAYERS.get(arch_name(arch)) if strategy == "pp" else None
    if strategy == "pp" and layers is None:
        built = arch.build()
        prefix = built.base_model_prefix
        layers = next(f"{prefix}.{k}" for k in built.config.base_model_pp_plan
                      if isinstance(dict(built.named_modules()).get(f"{prefix}.{k}"), nn.ModuleList))

    def body() -> dict:
        model, batch = arch.build(), arch.batch()
        out: dict = {}
        if routes:  # each experts module's routing choices per forward, in call order (one device: plain tensors)
            chosen = out["routes"] = []
            keys = {k for k, v in gt.hf.model_ep_plan(model).items() if v == "ep_dispatch_experts"}
            for name, m in model.named_modules():
                if gt.hf.generic_name(name) in keys:
                    m.register_forward_pre_hook(lambda mod, args: chosen.append(args[1].detach().clone()))
        pipe = None
        if strategy == "pp":
            stages = [gt.placement("cpu", [r]) for r in range(world)]
            gt.to_global(model, stages[0], gt.hf.pp_plan(model, stages, layers=PP_LAYERS.get(arch_name(arch))))
            pipe = gt.Pipeline(model, microbatches=2, schedule="1f1b")
            gt.reset_stats()
        elif strategy is not None:
            p = gt.placement("cpu", mesh_for(strategy, world))
            gt.to_global(model, p, plan_for(strategy, model, arch.row_local, p))
            batch = {k: gt.to_global(v, p, batch_sbp(strategy)) for k, v in batch.items()}
            gt.reset_stats()
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-2)
        losses = []
        with gt.comm_log() if strategy is not None else _nothing() as log:
            for i in range(steps):
                if i:
                    opt.zero_grad()
                if pipe is not None:
                    loss, res = pipe.step(**batch), None
                elif microbatches > 1:
                    n = len(next(iter(batch.values())))
                    loss, res = 0.0, None
                    for rows in torch.arange(n).tensor_split(microbatches):
                        part = model(**{k: v[rows] for k, v in batch.items()}).loss * (len(rows) / n)
                        part.backward()
                        loss = loss + part.detach()
                else:
                    res = model(**batch)
                    loss = res.loss
                    loss.backward()
                opt.step()
                losses.append(loss)
        out["type"] = type(res).__name__ if res is not None else None
        held = lambda q: not isinstance(q, gt.GlobalTensor) or gt.rank() in q.placement  # noqa: E731
        out["loss"] = _whole(loss).item() if held(loss) else None
        out["losses"] = [_whole(x).item() if held(x) else None for x in losses]
        out["grads"] = {n: None if q.grad is None else _whole(q.grad) for n, q in model.named_parameters()
                        if held(q)}
        out["params"] = {n: _whole(q) for n, q in model.named_parameters() if held(q)}
        if strategy is not None:
            out["fallback"] = dict(gt.stats()["fallback"])
            out["recv_bytes"] = log.recv_bytes
            out["collectives"] = len(log.events)
            out["events"] = [(e.kind, len(e.group), e.recv_bytes) for e in log.events]
            out["textbook"] = steps * textbook(model, strategy, world) if strategy in ("dp", "zero3") else None
            if strategy in ("ep", "dp_ep"):
                out["ep_sizes"] = ep_sizes(model)
            if strategy in ("dp_tp", "zero3_tp"):
                tp = textbook_dp_tp(model, world, acts, zero=strategy == "zero3_tp")
                out["textbook_dp_tp"] = None if tp is None else steps * tp
            if strategy == "pp":
                out["textbook_pp"] = steps * textbook_pp(model, layers, acts, 2)
        return out
    if strategy is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return body()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(body, world)
    if strategy != "pp":
        return results[0]
    merged = dict(results[-1])  # the last stage holds the loss
    for key in ("grads", "params"):
        merged[key] = {n: v for r in results for n, v in r[key].items()}
    merged["fallback"] = {k: v for r in results for k, v in r["fallback"].items()}
    return merged


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


__all__ = ["Arch", "ZOO", "step", "block_patterns", "plan_for", "has_tp_plan", "textbook"]
