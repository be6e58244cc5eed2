"""Expert-local modules: a routed experts module run as expert parallelism (`ModuleLayout(expert_local=True)`).

Why: transformers' experts modules (Mixtral's, Qwen2-MoE's, DeepSeek-V3's: `forward(hidden_states [T, d],
top_k_index [T, k], top_k_weights [T, k])`) sort the whole batch's routing choices by expert and loop or
grouped-GEMM over the experts. Written for one device, that program, run globally with the tokens split over
ranks and the experts' weights split by expert, would gather the tokens (or the weights) wherever the sort
and the products meet: the dispatcher cannot see that row t needs only its own k experts. The module's
contract says it, as it says it to transformers' own `EPImplementation`s: each output row is
sum_j top_k_weights[t, j] * f_{top_k_index[t, j]}(hidden_states[t]), and f_e reads only entry e of each
parameter [E, ...]. A plan that declares it (`ModuleLayout(expert_local=True)`, as `gt.hf.ep_plan` does
for transformers' "ep_dispatch_experts" style) gets expert parallelism from the one mechanism our own
dropless MoE uses (`models/moe.py`):

- the rows: each rank's tokens cut into routing groups (one per rank that holds a distinct block of them),
  each group's k choices sorted by expert and sent to their experts' ranks by `by_expert` (a count
  exchange, then one uneven all-to-all of exactly the routed rows: ragged on the expert axis);
- the experts: the module's own forward (its eager loop or its grouped GEMM, whatever its config says) on
  each rank's rows in plain torch, with its parameters swapped for their local shards (its experts), each
  row routed to its local expert with weight 1 (top-1), and `num_experts` (transformers' attribute, which
  its kernels size their offsets and masks from) set to the local count meanwhile, as transformers'
  `MoEParamShard` sets it;
- back: `by_group` (the all-to-all reversed) puts the results in the tokens' groups in choice order, where
  each token sums its k results times its routing weights, as the grouped implementation does
  (`(out * w).view(T, k, d).sum(1)`): the same products in the same order, so the same values.

Backward: each all-to-all's backward is the other's forward (the routed rows' gradients, no counts); the
local run's backward is the plain graph's, its parameters' gradients this rank's experts' (split on dim 0
on the expert axis; Partial on axes where other ranks hold other tokens' rows: EP x DP's data axis, reduced
by the gradient bucket as DDP does) and the rows' gradients ragged as the rows.

What is refused, by name: parameters not split on dim 0 over exactly one mesh axis and Broadcast elsewhere
(an expert split on another dim is tensor parallel: `gt.hf.tp_plan`'s "moe_tp_experts"); tokens that do
not divide into the ranks' groups.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from ..layout import Layout
from ..raggedtensor.grouped import by_expert, by_group
from ..raggedtensor.ops import convert, make
from ..runtime import context
from ..sbp import Broadcast, Partial, Ragged, Split
from ..tensor import GlobalTensor
from .local_call import Swap, call_local


class ExpertLocal:
    """A module declared expert-local: its calls run as expert parallelism (this module's docstring)."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        where = f"to_global(plan[{self.name!r}]) expert_local"
        try:
            bound = inspect.signature(forward).bind(self.module, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{where}: expected a call (hidden_states, top_k_index, top_k_weights): {e}") from None
        values = list(bound.arguments.values())[1:]
        if len(values) != 3 or not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError(f"{where}: expected a call (hidden_states [T, d], top_k_index [T, k], top_k_weights "
                            f"[T, k]), got {len(values)} arguments")
        x, index, weights = values
        if not isinstance(x, GlobalTensor):
            return forward(self.module, *args, **kwargs)
        slots = [(t, n) for m in self.module.modules() for t in (m._parameters, m._buffers) for n in t
                 if t[n] is not None]
        params = [table[n] for table, n in slots]
        axis = self._expert_axis(params, x.placement, where)
        n_expert = params[0].shape[0]
        if x.dim() != 2 or index.dim() != 2 or tuple(weights.shape) != tuple(index.shape) or \
                index.shape[0] != x.shape[0]:
            raise ValueError(f"{where}: expected hidden_states [T, d], top_k_index and top_k_weights [T, k]; got "
                             f"{tuple(x.shape)}, {tuple(index.shape)}, {tuple(weights.shape)}")
        tokens, d = x.shape
        k = index.shape[1]
        mesh = x.placement.shape
        # routing groups: one per distinct block of tokens (the axes that split them, and the expert axis, whose
        # ranks must each route their own), so that each rank's group is its own tokens and nothing moves here
        cuts = {a for a, s in enumerate(x.sbp) if s == Split(0)} | {axis}
        groups = math.prod(mesh[a] for a in cuts)
        if tokens % groups:
            raise ValueError(f"{where}: {tokens} tokens do not cut into {groups} routing groups (one per rank of the "
                             f"mesh axes {sorted(cuts)}); give a batch of tokens that divides over them")
        per = tokens // groups
        xs = x.reshape(groups, per, d)
        ids = index.reshape(groups, per * k)
        order = ids.argsort(dim=1, stable=True)                       # each group's choices by expert
        counts = F.one_hot(ids, n_expert).sum(1)                      # [G, E]
        rows, routing = by_expert(xs, counts, params[0], order // k)  # the dispatch all-to-all
        y = _LocalExperts.apply(self.module, slots, routing.per_expert, torch.is_grad_enabled(), rows, *params)
        out = by_group(y, routing, order.argsort(dim=1))              # the combine all-to-all, choice order
        out = (out * weights.reshape(groups, per * k, 1)).reshape(groups, per, k, -1).sum(2)
        return out.reshape(tokens, out.shape[-1]).to(x.dtype)

    @staticmethod
    def _expert_axis(params: list, placement: Any, where: str) -> int:
        if not params:
            raise ValueError(f"{where}: the module holds no parameters (its experts' weights [E, ...])")
        axes = set()
        for p in params:
            if not isinstance(p, GlobalTensor) or p.placement != placement:
                raise ValueError(f"{where}: every parameter must be a GlobalTensor on the tokens' placement")
            split = [a for a, s in enumerate(p.sbp) if s == Split(0)]
            if len(split) != 1 or any(not isinstance(s, Broadcast) for a, s in enumerate(p.sbp) if a != split[0]) \
                    or p.shape[0] != params[0].shape[0]:
                raise ValueError(f"{where}: a parameter of shape {tuple(p.shape)} is laid out {p.sbp}; an expert-local "
                                 "module's parameters [E, ...] are split on dim 0 (the experts) over one mesh axis, "
                                 "the same for all, and Broadcast elsewhere (an expert split on another dim is tensor "
                                 "parallel: gt.hf.tp_plan's 'moe_tp_experts')")
            axes.add(split[0])
        if len(axes) != 1:
            raise ValueError(f"{where}: the parameters are split by expert over different mesh axes {sorted(axes)}")
        return axes.pop()


class _LocalExperts(torch.autograd.Function):
    """The experts' rows (ragged on the expert axis) -> the module's own forward on this rank's rows with its
    experts' shards -> its results, ragged alike. The plain graph is kept and differentiated in the backward,
    so every rank of the expert axis takes part in the all-to-alls around it even if it ran no rows."""

    @staticmethod
    def forward(ctx, module, slots, per_expert, grad, rows, *params):  # type: ignore[override]
        inside = rows.placement.coord(context.current().rank) is not None
        ctx.rows_layout, ctx.rows_shape, ctx.sizes = rows._layout, tuple(rows.shape), rows._sizes
        ctx.params = [(p._layout, tuple(p.shape), p._local) for p in params]
        ctx.inside = inside
        if not inside:
            return make(rows._local.new_empty((0,)), rows._layout, rows.shape, rows._sizes)
        with torch.set_grad_enabled(grad):  # the plain graph only where a backward will read it
            leaf = rows._local.detach().requires_grad_(rows.requires_grad)
            locals_ = [p._local.detach().requires_grad_(p.requires_grad) for p in params]
            n_local = locals_[0].shape[0]
            ids = torch.arange(n_local, device=leaf.device).repeat_interleave(
                torch.tensor(per_expert, dtype=torch.long, device=leaf.device), output_size=leaf.shape[0]).unsqueeze(1)
            ones = torch.ones(leaf.shape[0], 1, dtype=leaf.dtype, device=leaf.device)
            swaps = [Swap(table, name, p, q) for (table, name), p, q in zip(slots, params, locals_)]
            saved = module.__dict__.get("num_experts", None)
            has = "num_experts" in module.__dict__
            if has:
                module.num_experts = n_local
            try:
                out = call_local(module, swaps, (leaf, ids, ones), {})
            finally:
                if has:
                    module.num_experts = saved
        ctx.graph = (out, leaf, locals_) if grad else None
        rows_layout = rows._layout
        return make(out.detach(), rows_layout, (rows.shape[0], out.shape[-1]), rows._sizes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        params = ctx.params
        if not ctx.inside:
            return (None, None, None, None,
                    make(grad._local.new_empty((0,)), ctx.rows_layout, ctx.rows_shape, ctx.sizes),
                    *[GlobalTensor(loc.new_empty((0,)), _param_grad_layout(lay, ctx.rows_layout), shape)
                      for lay, shape, loc in params])
        out, leaf, locals_ = ctx.graph
        ctx.graph = None
        if grad._layout != ctx.rows_layout or getattr(grad, "_sizes", None) != ctx.sizes:
            grad = convert(grad, ctx.rows_layout, ctx.sizes)
        wants = [t for t in [leaf, *locals_] if t.requires_grad]
        got = torch.autograd.grad(out, wants, grad._local, allow_unused=True) if out.requires_grad and wants else \
            [None] * len(wants)
        found = dict(zip(map(id, wants), got))
        grads = [found.get(id(t)) if t.requires_grad else None for t in [leaf, *locals_]]
        grads = [torch.zeros_like(t) if g is None and t.requires_grad else g for g, t in zip(grads, [leaf, *locals_])]
        g_rows = None if grads[0] is None else make(grads[0], ctx.rows_layout, ctx.rows_shape, ctx.sizes)
        g_params = [None if g is None else GlobalTensor(g, _param_grad_layout(lay, ctx.rows_layout), shape)
                    for g, (lay, shape, _) in zip(grads[1:], params)]
        return (None, None, None, None, g_rows, *g_params)


def _param_grad_layout(p: Layout, rows: Layout) -> Layout:
    """Split on the expert axis (this rank's experts' own gradient); Partial where the rows are cut on another
    axis (each rank's tokens' share: EP x DP's data axis); as the parameter elsewhere."""
    return Layout(p.placement, tuple(s if isinstance(s, Split) else Partial()
                                     if isinstance(t, (Ragged, Split)) and t.dim == 0 else s
                                     for s, t in zip(p.sbp, rows.sbp)))


__all__ = ["ExpertLocal"]
