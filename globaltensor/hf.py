"""Hugging Face transformers models: their own tensor-parallel, expert-parallel and pipeline plans as our module plans.

`gt.to_global(model, mesh, gt.hf.tp_plan(model, axis=1))` gives the model Megatron TP on mesh axis
`axis` from the plan the model ships (`model._tp_plan`, which transformers fills on a built model with
the base model's `config.base_model_tp_plan` under its prefix, e.g. "model."), instead of a plan
written by hand. Only the weights' layouts and the layouts at the named modules' boundaries are
taken from the style; the dispatcher derives every collective, so the results are those of the same
model on one device whatever the styles say. A style whose meaning needs local (per-rank) semantics
that a global program has no words for raises `NotImplementedError` naming it and its module.

`gt.hf.ep_plan(model, axis=0)` gives a mixture of experts expert parallelism from the plan it ships for that
(`config.base_model_ep_plan`): its experts' weights split by expert, its experts module declared
expert-local (`ModuleLayout(expert_local=True)`), which runs it as our dropless MoE runs its experts: the
routed rows sent to their experts' ranks and back, one all-to-all each way.

Nothing here imports transformers: the plan is read as plain dicts from the model and its config.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Any, Mapping, Optional, Sequence

import torch

from .layout import Layout, normalize_sbp
from .parallel.module import ModuleLayout
from .placement import Placement
from .sbp import Broadcast, Ragged, SbpLike, Split, Strided

__all__ = ["tp_plan", "ep_plan", "pp_plan", "model_tp_plan", "model_ep_plan", "generic_name", "BASE_TP_PLANS"]

# Megatron plans, in `config.base_model_tp_plan`'s form (keys relative to the base model), for architectures whose
# transformers classes ship none, by `config.model_type`: each attention's query, key and value projections
# column-parallel (heads split), its output projection row-parallel, the MLP's first linear column-parallel and
# its second row-parallel, as the decoders' own plans write it. The embeddings, norms and heads stay whole.
BASE_TP_PLANS: dict[str, dict[str, str]] = {
    "vit": {  # ViTModel (transformers 5: `layers.N.attention.{q,k,v,o}_proj`, `layers.N.mlp.fc{1,2}`)
        "layers.*.attention.q_proj": "colwise", "layers.*.attention.k_proj": "colwise",
        "layers.*.attention.v_proj": "colwise", "layers.*.attention.o_proj": "rowwise",
        "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise",
    },
    "convnext": {  # ConvNextModel: each block's pointwise MLP (channels last: [batch, height, width, channels])
        "encoder.stages.*.layers.*.pwconv1": "colwise", "encoder.stages.*.layers.*.pwconv2": "rowwise",
    },
}

# styles that have no exact global meaning here (local per-rank semantics, a fused projection's own kernel, an
# identity expert pre-divided for a sum the global program does not make, the expert-parallel router transformers
# removed); the expert-parallel styles of `config.base_model_ep_plan` are `ep_plan`'s (`_EP_STYLES`)
_UNSUPPORTED = {
    "local_colwise", "local_rowwise", "local", "local_params", "isolated", "all_reduce",
    "mla_kv_a_proj", "moe_identity_expert", "ep_router",
}
# expert parallelism's styles (transformers' `base_model_ep_plan`), mapped by `ep_plan`, refused by `tp_plan`
_EP_STYLES = {"grouped_gemm", "ep_dispatch_experts"}
# a plan key that names a parameter (an experts module's [experts, out, in] weights): the dim each style splits,
# as transformers' styles shard a parameter of that many dims (None: whole)
_PARAM_DIM = {
    "colwise": lambda nd: max(nd - 2, 0),
    "packed_colwise": lambda nd: max(nd - 2, 0),
    "rowwise": lambda nd: nd - 1,
    "packed_rowwise": lambda nd: nd - 1 if nd > 1 else None,
}
_PACKED = {"packed_colwise", "packed_rowwise"}  # two projections packed on the dim: strided, each rank a slice of both


def _mesh_ndim(fn: str, axis: int, ndim: Optional[int]) -> int:
    """The mesh's number of axes (default `axis + 1`), checked to hold `axis`."""
    ndim = axis + 1 if ndim is None else ndim
    if not 0 <= axis < ndim:
        raise ValueError(f"gt.hf.{fn}(axis={axis}): not an axis of a {ndim}-axis mesh")
    return ndim


def generic_name(name: str) -> str:
    """`name` with each layer number between dots replaced by "*", as transformers matches plan keys
    (`replace_layer_number_by_wildcard`): "model.layers.0.mlp" -> "model.layers.*.mlp"."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def model_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The transformers TP plan of `model`, keys relative to `model`: its `_tp_plan` (a built model's,
    base-model keys already prefixed), else its config's `base_model_tp_plan`, else `BASE_TP_PLANS`'
    entry for its `config.model_type` (an architecture that ships none), under the base model's prefix
    when `model` wraps the base model (LlamaForCausalLM's "model.", ViTForImageClassification's "vit.")."""
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None)
                or BASE_TP_PLANS.get(getattr(config, "model_type", None), {}))
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and isinstance(getattr(model, prefix, None), torch.nn.Module):
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return base


def tp_plan(model: torch.nn.Module, axis: int = 0, ndim: Optional[int] = None,
            plan: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The model's transformers TP plan (`model_tp_plan`; or `plan`, keys relative to `model`) as our module
    plan on mesh axis `axis` of an `ndim`-axis mesh (default `axis + 1`): parameter SBPs are Broadcast, and
    ModuleLayout entries None, on the other axes, so a data axis is left to the batch's layout.

    Styles (nn.Linear weight [out, in]; nn.Embedding weight [vocab, dim]):
    - "colwise": weight and bias split on dim 0, so the output comes out split on its last dim; the
      input's gradient (Partial) is all-reduced (`input_grad=B`), as Megatron's f does: at the module, or, where
      two or more column-parallel modules are children of one module (the attention's q, k and v, the MLP's
      gate and up), once at that parent (`_reduce_at_parents`), as `models/gpt.py` does.
    - "colwise_rep", "colwise_gather_output": colwise, output gathered (`output=B`).
    - "rowwise", "rowwise_rep": weight split on dim 1, bias whole; the output (Partial) all-reduced
      (`output=B`). "rowwise_split_input" likewise: a whole input is split by the dispatcher for the
      split weight (a ModuleLayout cannot say "last dim" without the input's rank, and its result is
      the same).
    - "embedding_rowwise": vocab-parallel embedding (weight split on dim 0, output Partial, reduced
      `output=B`); "embedding_colwise": weight split on dim 1, output gathered (`output=B`).
    - "sequence_parallel" (a norm's): input split on dim 1, the sequence of [batch, seq, hidden], weights
      whole; the output stays as computed (split), as transformers' `SequenceParallel(sequence_dim=1)`.
    - "gather": output gathered (`output=B`); "replicate", "replicated_with_grad_allreduce": whole
      weights (a Broadcast weight's gradient is already the whole sum here).
    Mixtures of experts (Mixtral, Qwen2-MoE, DeepSeek-V3, Llama 4: an experts module holding 3-D weights
    [experts, out, in], which the plan names as parameters):
    - "colwise" / "rowwise" of a parameter: split on its dim -2 / -1 (the expert's out / in), as transformers
      shards a parameter.
    - "packed_colwise" (gate_up_proj [experts, 2I, hidden]: gate and up packed on dim -2; a Linear's weight and
      bias on dim 0) and "packed_rowwise" (Llama 4's [experts, hidden, 2I], packed on dim -1): a strided split
      of the packed dim in two groups (`gt.strided(d, 2)`, transformers' `_StridedShard`): each rank holds its
      slice of gate and its slice of up. The projection's output is then strided on its last dim, and the
      forward's `gate, up = proj.chunk(2, -1)` gives each rank its own slice of each (two plain splits of I,
      no bytes), as the backward's `cat` of their gradients gives the strided gradient back
      (`ops/strided_split.py`); the grouped experts' `_grouped_mm` and the eager experts' `gate_up_proj[e]`
      keep it too. A contiguous split would recut both halves each time (a rank's columns would
      be all gate or all up): S*I/2 elements a rank on 2 ranks, with S = tokens x k routed rows.
    - "moe_tp_experts" (the experts module): input whole (`input=B`) and its gradient all-reduced
      (`input_grad=B`), the output (Partial: each rank summed its slice of every expert's intermediate dim)
      all-reduced, as transformers' `MoeExpertsParallel`; on the other mesh axes the output's rows go back to
      the cut the input's tokens arrived in (`gt.ragged(0)`: a data axis's split, or whole), since the
      experts' sort of the whole batch's tokens leaves their sum Partial there, which the next layer would
      otherwise reduce piecemeal. The routing weights' gradient (the module's third argument) is all-reduced
      at the boundary too (`arg_grads={2: B}`), as transformers' `_AllReduceBackward` and Megatron do: left to
      the dispatcher, it was reduce-scattered over the tokens (cheapest for that op), and the residual stream's
      gradient then arrived split at the module before and was gathered there, 9x the routing weights' bytes
      on Mixtral.
    Others (local, fused-attention and identity-expert styles, and "ep_router", which transformers removed)
    raise NotImplementedError: they name per-rank behaviour that this mapping does not reproduce. The
    expert-parallel styles ("grouped_gemm", "ep_dispatch_experts") are `ep_plan`'s, from the model's
    `base_model_ep_plan`; here they are refused, naming it.

    Keys keep transformers' "*" for layer numbers where the fnmatch glob over `named_modules` matches
    the same modules as transformers' rule (a "*" there stands for a layer number only); where the glob
    would reach more (fnmatch's "*" crosses dots), the modules are named one by one. Keys naming no
    module are skipped, as transformers skips them. Parameter entries are emitted only for weights and biases
    that exist ("<key>.weight", "<key>.bias"), so `to_global` finds a match for each.
    """
    ndim = _mesh_ndim("tp_plan", axis, ndim)
    source = dict(plan) if plan is not None else model_tp_plan(model)
    if not source:
        raise ValueError(f"gt.hf.tp_plan: {type(model).__name__} ships no TP plan (no `_tp_plan`, no "
                         "`config.base_model_tp_plan`, no entry in gt.hf.BASE_TP_PLANS for its model_type); pass "
                         "plan={pattern: style}, keys relative to the model")

    def on_axis(s: Any) -> tuple:
        return tuple(s if a == axis else Broadcast() for a in range(ndim))

    def hint(s: Any) -> tuple:
        return tuple(s if a == axis else None for a in range(ndim))

    B, col, row = hint(Broadcast()), on_axis(Split(0)), on_axis(Split(1))
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    out: dict[str, Any] = {}
    layouts: dict[str, Any] = {}
    colwise: list = []  # (key, the keys it was emitted as, its modules) of each column-parallel style
    for key, style in source.items():
        theirs = sorted(n for n in modules if generic_name(n) == key)
        ours = sorted(n for n in modules if fnmatch.fnmatchcase(n, key))
        if not theirs:
            named = sorted(n for n in params if generic_name(n) == key)
            if named:  # the key names parameters (an experts module's 3-D weights [experts, out, in]), not modules
                for n in named:
                    dim = _PARAM_DIM.get(style)
                    if dim is None:
                        raise NotImplementedError(f"gt.hf.tp_plan: style {style!r} of parameter pattern {key!r} is "
                                                  f"not mapped for a parameter (mapped: {sorted(_PARAM_DIM)})")
                    split = dim(params[n].dim())
                    cut = Split(split) if style not in _PACKED or split is None else Strided(split, 2)
                    out[n] = on_axis(cut) if split is not None else on_axis(Broadcast())
            continue  # transformers also skips keys naming no module of this model
        # an fnmatch "*" also crosses dots: where the glob would reach other modules than transformers' rule
        # does (a key "model.layers.*" is the layers, not also their children), name the modules themselves
        keys = [key] if theirs == ours else theirs
        where = f"gt.hf.tp_plan: style {style!r} of module pattern {key!r}"
        if style in _EP_STYLES:
            raise NotImplementedError(f"{where} is an expert-parallel style: gt.hf.ep_plan maps it")
        if style in _UNSUPPORTED:
            raise NotImplementedError(f"{where} is not mapped: it names per-rank (local), fused or expert "
                                      "behaviour this mapping does not reproduce exactly; give that entry "
                                      "yourself in the plan (plan=...) or drop it")
        weight = bias = layout = None
        if style == "moe_tp_experts":
            # the output's rows handed back in the tokens' cut the input arrived in on the other axes: transformers'
            # experts sort the whole batch's tokens by expert, which leaves their sum Partial over a data axis
            layout = ModuleLayout(input=B, input_grad=B, arg_grads={2: B},
                                  output=tuple(Broadcast() if a == axis else Ragged(0) for a in range(ndim)))
        elif style in ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"):
            weight, bias = (col, col) if style != "packed_colwise" else (on_axis(Strided(0, 2)),) * 2
            layout = ModuleLayout(input_grad=B, output=B if style != "colwise" else None)
        elif style in ("rowwise", "rowwise_rep", "rowwise_split_input"):
            weight = row
            layout = ModuleLayout(output=B)
        elif style == "embedding_rowwise":
            weight = col
            layout = ModuleLayout(output=B)
        elif style == "embedding_colwise":
            weight = row
            layout = ModuleLayout(output=B)
        elif style == "gather":
            layout = ModuleLayout(output=B)
        elif style == "sequence_parallel":
            layout = ModuleLayout(input=hint(Split(1)))
        elif style in ("replicate", "replicated_with_grad_allreduce"):
            pass
        else:
            raise NotImplementedError(f"{where} is unknown to this mapping")
        if style in _COLWISE:
            colwise.append((key, keys, theirs))
        for k in keys:
            if layout is not None:
                layouts[k] = layout
            for suffix, sbp in (("weight", weight), ("bias", bias)):
                if sbp is not None and any(f"{n}.{suffix}" in params for n in (theirs if k == key else [k])):
                    out[f"{k}.{suffix}"] = sbp
    _reduce_at_parents(colwise, modules, layouts, B)
    out.update(layouts)
    return out


# column-parallel styles: the module's input gradient is Partial over the tensor axis, reduced once for the siblings
# that read one input (`_reduce_at_parents`)
_COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"}


def _reduce_at_parents(colwise: list, modules: Mapping[str, torch.nn.Module], layouts: dict, B: tuple) -> None:
    """Megatron's f operator once per block: where two or more column-parallel modules are children of one module
    (an attention's q, k and v; an MLP's gate and up), that parent, which hands them its first argument (a
    transformers decoder layer passes it by keyword: `self_attn(hidden_states=...)`), all-reduces its input's
    gradient (`input_grad=B`), and its children leave theirs Partial: one all-reduce of [tokens, hidden] instead
    of one per child. A parent the plan lays out itself, or the root, keeps the children's own reductions; so
    does a parent whose children read other inputs than its first (a cross-attention's k and v read the
    encoder's states): their gradients are then reduced where the dispatcher finds it cheapest, equal values."""
    children: dict[str, int] = {}
    for _, _, names in colwise:
        for n in names:
            parent = n.rpartition(".")[0]
            children[parent] = children.get(parent, 0) + 1
    hinted = {p for p, c in children.items() if c >= 2 and p and modules.get(p) is not None
              and not any(fnmatch.fnmatchcase(p, k) for k in layouts if layouts[k].input_grad is not None
                          or layouts[k].input is not None or layouts[k].output is not None)}
    if not hinted:
        return
    for key, keys, names in colwise:
        if not all(n.rpartition(".")[0] in hinted for n in names):
            continue
        for k in keys:
            old = layouts.pop(k)
            if old.output is not None:
                layouts[k] = ModuleLayout(output=old.output)
    generic = {generic_name(p) for p in hinted}
    for g in sorted(generic):
        theirs = sorted(n for n in modules if generic_name(n) == g)
        ours = sorted(n for n in modules if fnmatch.fnmatchcase(n, g))
        for k in ([g] if theirs == ours and set(theirs) <= hinted else sorted(set(theirs) & hinted)):
            layouts[k] = ModuleLayout(input_grad=B)


def model_ep_plan(model: torch.nn.Module) -> dict[str, str]:
    """The transformers expert-parallel plan of `model`, keys relative to `model`: its `_ep_plan` (a built model's,
    base-model keys already prefixed), else its config's `base_model_ep_plan` under the base model's prefix."""
    plan = getattr(model, "_ep_plan", None)
    if plan:
        return dict(plan)
    base = dict(getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and isinstance(getattr(model, prefix, None), torch.nn.Module):
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return base


def ep_plan(model: torch.nn.Module, axis: int = 0, ndim: Optional[int] = None,
            plan: Optional[Mapping[str, str]] = None, tp_axis: Optional[int] = None) -> dict[str, Any]:
    """The model's transformers expert-parallel plan (`model_ep_plan`: `config.base_model_ep_plan` under the base
    model's prefix; or `plan`, keys relative to `model`) as our module plan, experts split over mesh axis `axis`
    of an `ndim`-axis mesh (default `axis + 1`); every other parameter is Broadcast, so the batch's layout
    makes the rest data parallel (split the batch over `axis` too: each rank routes its own tokens, as
    DeepSpeed-MoE's and transformers' `AllToAllEP` do; on another axis as well for EP x DP).

    Styles:
    - "grouped_gemm" (an experts module's parameter [E, ...]: Mixtral's gate_up_proj, down_proj): split on
      dim 0, the experts, over `axis`; Broadcast on the other axes (each data rank holds the same experts).
    - "ep_dispatch_experts" (the experts module, `forward(hidden_states, top_k_index, top_k_weights)`):
      `ModuleLayout(expert_local=True)`: each routed row sent to its expert's rank and its result back, one
      all-to-all each way, the module's own forward (eager loop or grouped GEMM) run on each rank's rows with
      its experts (`globaltensor/parallel/experts.py`). The global program of that forward (a sort of the whole
      batch's choices, a loop or grouped product over experts, an index back) has no rule that reads "row t
      needs only its k experts" off it; the module's contract, which transformers' own `EPImplementation`s
      rely on, says it, and the plan declares it, as `row_local` declares a row-wise block.
    Any other style in an EP plan (a tensor-parallel one some configs put there) raises NotImplementedError
    naming it: give it to `tp_plan`.

    `tp_axis` (EP x TP): the model's TP plan (`tp_plan(model, axis=tp_axis, ndim=ndim)`) on that axis as well,
    without its entries for the EP plan's modules and parameters and anything under them, as transformers
    drops them ("EP rules take precedence"): attention and the dense parts Megatron-style, the experts whole
    on the tensor axis. The tokens are then whole on the tensor axis (split the batch on `axis` only): each
    rank of a tensor group dispatches the same rows to the same experts, and the experts' results are
    computed once per tensor rank, where transformers' `AllToAllEP` slices the rows over the tensor group
    and gathers the results after.

    A function of its own, not a `tp_plan` option, because transformers keeps the two plans apart
    (`model.ep_plan` beside `model.tp_plan`, `DistributedConfig(ep_size=)` beside `tp_size`): EP goes on a
    mesh axis of its own (usually the data axis), and its entries win over TP's on the expert modules.
    """
    ndim = _mesh_ndim("ep_plan", axis, ndim)
    source = dict(plan) if plan is not None else model_ep_plan(model)
    if not source:
        raise ValueError(f"gt.hf.ep_plan: {type(model).__name__} ships no expert-parallel plan (no `_ep_plan`, no "
                         "`config.base_model_ep_plan`); pass plan={pattern: style}, keys relative to the model")
    experts = tuple(Split(0) if a == axis else Broadcast() for a in range(ndim))
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    out: dict[str, Any] = {}
    for key, style in source.items():
        if style == "grouped_gemm":
            named = sorted(n for n in params if generic_name(n) == key)
            ours = sorted(n for n in params if fnmatch.fnmatchcase(n, key))
            for k in ([key] if named and named == ours else named):
                out[k] = experts
        elif style == "ep_dispatch_experts":
            named = sorted(n for n in modules if generic_name(n) == key)
            ours = sorted(n for n in modules if fnmatch.fnmatchcase(n, key))
            for k in ([key] if named and named == ours else named):
                out[k] = ModuleLayout(expert_local=True)
        else:
            raise NotImplementedError(f"gt.hf.ep_plan: style {style!r} of pattern {key!r} is not an expert-parallel "
                                      f"style mapped here (mapped: {sorted(_EP_STYLES)}); give it to gt.hf.tp_plan "
                                      "or drop it (plan=...)")
    if tp_axis is None:
        return out
    if tp_axis == axis or not 0 <= tp_axis < ndim:
        raise ValueError(f"gt.hf.ep_plan(tp_axis={tp_axis}): give a mesh axis of the {ndim}-axis mesh other than the "
                         f"expert axis {axis}")
    # transformers' rule (`_resolve_parallel_plans`): a TP entry naming an EP key, or anything under one, is dropped
    expert = re.compile(rf"(?:{'|'.join(re.escape(generic_name(k)) for k in source)})(?:\..+)?").fullmatch
    for k, v in tp_plan(model, axis=tp_axis, ndim=ndim).items():
        if not expert(generic_name(k)):
            out[k] = v
    return out


def pp_plan(model: torch.nn.Module, stages: Sequence[Placement], sbp: Optional[SbpLike] = None,
            layers: Optional[str] = None) -> dict[str, Any]:
    """The model's transformers pipeline plan (`config.base_model_pp_plan`) cut into `stages`: a plan
    for `gt.to_global(model, stages[0], plan)` placing every parameter and buffer on one stage, for
    `gt.Pipeline`.

    The pp plan names the base model's modules in the order its forward runs them, with the tensors
    that cross them ({"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states",
    ...], ...), "norm": ...}). Its repeated modules (an nn.ModuleList: the decoder layers) are cut into
    contiguous runs, as even as their count allows (layer i on stage i * len(stages) // n); a module
    named before them goes to the first stage, one after them to the last. Outside the pp plan, a
    module that holds buffers but no parameters (the rotary embedding's frequencies, which the forward
    reads before the first layer) goes to the first stage, everything else (the LM head) to the last.
    `sbp`: the layout on each stage (default Broadcast; e.g. a data axis split of a 2-D stage).
    `layers`: the name of the nn.ModuleList to cut (ViT's "vit.layers", BERT's "bert.encoder.layer"), for a
    model whose config has no pp plan (or instead of it). Without a plan that says what runs before the
    layers, the order the modules were registered in (`named_modules()`, which transformers' models keep in
    forward order) says it: a module with parameters registered before the layers (the embeddings) goes to
    the first stage, one after them (the final norm, the head) to the last; buffer-only ones as above. A
    module registered out of its forward order lands on a stage out of turn, which `gt.Pipeline` refuses,
    naming the order the stages are visited in: add its entry to the plan yourself.
    A tied weight used on two stages (an LM head tied to the embedding) is stored on the stage of its
    first name and used on the other's by a `ModuleLayout(params=gt.Layout(stage, ...))` on the module
    that reads it there: its value sent at that module's forward, its gradient sent back and summed.
    """
    stages = list(stages)
    if len(stages) < 2:
        raise ValueError(f"gt.hf.pp_plan(stages): give at least two stage placements, got {len(stages)}")

    def on(stage: Placement) -> Layout:
        return Layout(stage, normalize_sbp(Broadcast() if sbp is None else sbp, stage.ndim, "gt.hf.pp_plan(sbp)"))

    def holds(mod: torch.nn.Module, what: str) -> bool:
        return any(True for _ in getattr(mod, what)())

    modules = dict(model.named_modules())
    plan: dict[str, Any] = {}

    def cut(full: str, mod: torch.nn.Module) -> None:
        n = len(mod)
        for i in range(n):
            plan[f"{full}.{i}.*"] = on(stages[i * len(stages) // n])

    if layers is not None:
        mod = modules.get(layers)
        if not isinstance(mod, torch.nn.ModuleList) or not len(mod):
            lists = [n for n, m in modules.items() if isinstance(m, torch.nn.ModuleList) and len(m)]
            raise ValueError(f"gt.hf.pp_plan(layers={layers!r}): "
                             f"{'no module of that name' if mod is None else 'not a non-empty nn.ModuleList'} in "
                             f"{type(model).__name__}; its repeated modules: {lists}")
        cut(layers, mod)
        names = list(modules)
        at = names.index(layers)
        for name in names[:at]:
            m = modules[name]
            if (not name or layers.startswith(name + ".") or any(name.startswith(p.rstrip("*")) for p in plan)
                    or not holds(m, "parameters")):
                continue  # the root and the layers' parents (they hold the layers), or already placed, or no weights
            plan[f"{name}.*"] = on(stages[0])
    else:
        config = getattr(model, "config", None)
        base_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
        if not base_plan:
            raise ValueError(f"gt.hf.pp_plan: {type(model).__name__}'s config has no `base_model_pp_plan`; name its "
                             "repeated layers (layers='...', an nn.ModuleList), or lay its modules on stages yourself "
                             "({'pattern.*': gt.Layout(stage, sbp)})")
        prefix = getattr(model, "base_model_prefix", "")
        if not (prefix and isinstance(getattr(model, prefix, None), torch.nn.Module)):
            prefix = ""
        seen_repeated = False
        for name in base_plan:
            full = f"{prefix}.{name}" if prefix else name
            mod = modules.get(full)
            if mod is None:
                continue
            if not holds(mod, "parameters") and not holds(mod, "buffers"):
                continue  # holds nothing to place (a dropout)
            if isinstance(mod, torch.nn.ModuleList):
                cut(full, mod)
                seen_repeated = True
            else:
                plan[f"{full}.*"] = on(stages[-1] if seen_repeated else stages[0])
        if not seen_repeated:
            raise ValueError(f"gt.hf.pp_plan: {type(model).__name__}'s base_model_pp_plan {list(base_plan)} names no "
                             "repeated module (nn.ModuleList) to cut into stages; name it (layers='...')")
    placed = [p.rstrip("*").rstrip(".") for p in plan]
    for name, mod in modules.items():
        if not name or any(name == p or name.startswith(p + ".") or p.startswith(name + ".") for p in placed):
            continue
        if holds(mod, "buffers") and not holds(mod, "parameters"):
            plan[f"{name}.*"] = on(stages[0])
            placed.append(name)
    plan["*"] = on(stages[-1])
    ties: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(n)
    for names in ties.values():
        home = _stage_of(names[0], plan)
        for n in names[1:]:
            stage = _stage_of(n, plan)
            if stage != home:
                # a tied weight (the LM head's, the embedding's) used on another stage: stored on its first name's,
                # sent to the other for the forward of the module that reads it there
                plan[n.rpartition(".")[0]] = ModuleLayout(params=Layout(stage, on(stage).sbp))
    return plan


def _stage_of(name: str, plan: Mapping[str, Any]) -> Any:
    return next(v.placement for k, v in plan.items() if isinstance(v, Layout) and fnmatch.fnmatchcase(name, k))

