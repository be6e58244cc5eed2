"""Hugging Face transformers models: their own tensor-parallel plan as our module plan.

`gt.to_global(model, mesh, gt.hf.tp_plan(model, axis=1))` gives the model Megatron TP on mesh axis
`axis` from the plan the model ships (`model._tp_plan`, which transformers fills on a built model with
the base model's `config.base_model_tp_plan` under its prefix, e.g. "model."), instead of a plan
written by hand. Only the weights' layouts and the layouts at the named modules' boundaries are
taken from the style; the dispatcher derives every collective, so the results are those of the same
model on one device whatever the styles say. A style whose meaning needs local (per-rank) semantics
that a global program has no words for raises `NotImplementedError` naming it and its module.

Nothing here imports transformers: the plan is read as plain dicts from the model and its config.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Any, Mapping, Optional

import torch

from .parallel.module import ModuleLayout
from .sbp import Broadcast, Split

__all__ = ["tp_plan", "model_tp_plan", "generic_name"]

# styles that have no exact global meaning (local per-rank semantics, fused/packed weights, experts)
_UNSUPPORTED = {
    "local_colwise", "local_rowwise", "local", "local_params", "isolated", "all_reduce",
    "packed_colwise", "packed_rowwise", "mla_kv_a_proj", "moe_tp_experts", "moe_identity_expert",
    "ep_router", "ep_dispatch_experts", "grouped_gemm",
}


def generic_name(name: str) -> str:
    """`name` with each layer number between dots replaced by "*", as transformers matches plan keys
    (`replace_layer_number_by_wildcard`): "model.layers.0.mlp" -> "model.layers.*.mlp"."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def model_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The transformers TP plan of `model`, keys relative to `model`: its `_tp_plan` (a built model's,
    base-model keys already prefixed), else its config's `base_model_tp_plan` under the base model's
    prefix when `model` wraps the base model (LlamaForCausalLM's "model.")."""
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and isinstance(getattr(model, prefix, None), torch.nn.Module):
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return base


def tp_plan(model: torch.nn.Module, axis: int = 0, ndim: Optional[int] = None,
            plan: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The model's transformers TP plan (or `plan`, keys relative to `model`) as our module plan on mesh
    axis `axis` of an `ndim`-axis mesh (default `axis + 1`): parameter SBPs are Broadcast, and
    ModuleLayout entries None, on the other axes, so a data axis is left to the batch's layout.

    Styles (nn.Linear weight [out, in]; nn.Embedding weight [vocab, dim]):
    - "colwise": weight and bias split on dim 0, so the output comes out split on its last dim; the
      input's gradient (Partial) is all-reduced at the module (`input_grad=B`), as Megatron does.
      The reduction is per module (q, k and v each), not once per attention block as `models/gpt.py`
      does: a decoder layer calls its attention with keyword arguments, which a ModuleLayout's `input`
      (the first positional argument) does not see, and leaving the gradient to the dispatcher costs
      more collectives than the three all-reduces.
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
    Others (local, packed, expert styles) raise NotImplementedError: they name
    per-rank behaviour or fused layouts that this mapping does not reproduce.

    Keys keep transformers' "*" for layer numbers where the fnmatch glob over `named_modules` matches
    the same modules as transformers' rule (a "*" there stands for a layer number only); where the glob
    would reach more (fnmatch's "*" crosses dots), the modules are named one by one. Keys naming no
    module are skipped, as transformers skips them. Parameter entries are emitted only for weights and biases
    that exist ("<key>.weight", "<key>.bias"), so `to_global` finds a match for each.
    """
    if ndim is None:
        ndim = axis + 1
    if not 0 <= axis < ndim:
        raise ValueError(f"gt.hf.tp_plan(axis={axis}): not an axis of a {ndim}-axis mesh")
    source = dict(plan) if plan is not None else model_tp_plan(model)
    if not source:
        raise ValueError(f"gt.hf.tp_plan: {type(model).__name__} ships no TP plan (no `_tp_plan`, no "
                         "`config.base_model_tp_plan`); pass plan={pattern: style}")

    def on_axis(s: Any) -> tuple:
        return tuple(s if a == axis else Broadcast() for a in range(ndim))

    def hint(s: Any) -> tuple:
        return tuple(s if a == axis else None for a in range(ndim))

    B, col, row = hint(Broadcast()), on_axis(Split(0)), on_axis(Split(1))
    modules = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters()}
    out: dict[str, Any] = {}
    layouts: dict[str, Any] = {}
    for key, style in source.items():
        theirs = sorted(n for n in modules if generic_name(n) == key)
        ours = sorted(n for n in modules if fnmatch.fnmatchcase(n, key))
        if not theirs:
            continue  # transformers also skips keys naming no module of this model
        # an fnmatch "*" also crosses dots: where the glob would reach other modules than transformers' rule
        # does (a key "model.layers.*" is the layers, not also their children), name the modules themselves
        keys = [key] if theirs == ours else theirs
        where = f"gt.hf.tp_plan: style {style!r} of module pattern {key!r}"
        if style in _UNSUPPORTED:
            raise NotImplementedError(f"{where} is not mapped: it names per-rank (local), fused or expert "
                                      "behaviour this mapping does not reproduce exactly; give that entry "
                                      "yourself in the plan (plan=...) or drop it")
        weight = bias = layout = None
        if style in ("colwise", "colwise_rep", "colwise_gather_output"):
            weight, bias = col, col
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
        for k in keys:
            if layout is not None:
                layouts[k] = layout
            for suffix, sbp in (("weight", weight), ("bias", bias)):
                if sbp is not None and any(f"{n}.{suffix}" in params for n in (theirs if k == key else [k])):
                    out[f"{k}.{suffix}"] = sbp
    out.update(layouts)
    return out
