"""A GPT whose MLPs are mixture-of-experts layers, written for one device, plus its plans as SBPs.

The layer is GShard's grouped formulation (Switch's when k = 1): tokens are cut into groups
`[G, S, d]`, each group routes its own tokens with top-k gating and a per-group capacity `C`
(choice j fills an expert's slots after every choice < j of the group; what overflows is dropped
and passes through the residual only), and the dispatched tokens are one `[E, G, C, d]` tensor.
Everything the router does works along the group's own dims (S, E, C), never across groups, so
with the group dim split over ranks the router is local; the experts' weights `[E, ...]` split
on E make the expert computation local too. Between the two, the dispatched tensor changes from
split on G to split on E and back: `S(1) -> S(0)` and `S(0) -> S(1)`, each exactly one
all-to-all, which is all the plan has to say (`ep_plan`). Nothing here communicates.

Dropless (`MoEConfig(dropless=True)`, Megablocks' and Megatron's): no capacity, no padding. Each
group sorts its k*S choices by expert and counts them per expert (`[G, E]`); `by_expert` turns the
sorted rows into one expert-major tensor (on global tensors: a count exchange, then an uneven
all-to-all of exactly the routed rows, leaving them ragged on the expert axis), the experts run a
grouped linear layer per expert, and `by_group` takes the rows back to their groups, where each
token sums its k gate-weighted outputs. The plan only places the experts (`ep_plan(dropless=True)`).

Auxiliary loss: GShard's / Switch's load-balancing term, E * sum_e (fraction of the group's
tokens whose first choice is e) * (mean router probability of e), averaged over groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..raggedtensor.grouped import by_expert, by_group, grouped_linear
from ..parallel.module import ModuleLayout
from ..sbp import Broadcast, Ragged, Split
from .gpt import GPT, CausalSelfAttention, GPTConfig, tp_plan


@dataclass
class MoEConfig(GPTConfig):
    """nanoGPT's sizes plus the MoE layer's: E experts of hidden size `expert_hidden`, top-k routing
    with a capacity factor, routing groups of `group_size` tokens, the aux loss's weight."""
    n_expert: int = 4
    expert_hidden: int = 64
    top_k: int = 2
    capacity_factor: Optional[float] = 1.25   # None: no token dropped (capacity = group size, padded)
    group_size: Optional[int] = None   # tokens per routing group; None: one sequence per group
    aux_loss_coef: float = 0.01
    normalize_top_k: bool = True       # GShard: renormalise the k gate values to sum to 1 (k > 1)
    dropless: bool = False             # every choice computed, rows ragged per expert (capacity_factor unused)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"MoEConfig(top_k={self.top_k}): must be between 1 and n_expert={self.n_expert}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig(capacity_factor={self.capacity_factor}): must be > 0, or None (dropless)")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"MoEConfig(group_size={self.group_size}): must be >= 1, or None (one sequence)")


def capacity(cfg: MoEConfig, group_size: int) -> int:
    """Slots per expert per group: ceil(k * capacity_factor * S / E), at least 1 (GShard).

    `capacity_factor=None` is dropless by padding: S slots, as many as a group has tokens (top-k picks
    k distinct experts, so no expert gets more), at E / k times the bytes of the routed tokens. Dropless
    at exactly the routed bytes needs a ragged split (docs/design.md, proposed)."""
    if cfg.capacity_factor is None:
        return group_size
    return max(1, math.ceil(cfg.top_k * cfg.capacity_factor * group_size / cfg.n_expert))


def top_k_gating(probs: torch.Tensor, k: int, cap: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with capacity, per group: probs [G, S, E] -> (dispatch [G, S, E, C] of 0/1,
    combine [G, S, E, C] of gate weights, kept [G, S, k] of 0/1: which choices got a slot).

    Every op works along S, E or C of one group (topk over E, cumsum over the group's choices,
    one_hot into E and C), so a split of G passes through all of them.
    """
    g, s, e = probs.shape
    top_p, top_i = probs.topk(k, dim=-1)                              # [G, S, k]
    if normalize and k > 1:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    masks = F.one_hot(top_i, e)                                       # [G, S, k, E]
    # slot of each choice in its expert: choice-major order, so choice j queues after all choices < j
    order = masks.transpose(1, 2).reshape(g, k * s, e)
    pos = (order.cumsum(1) - 1).reshape(g, k, s, e).transpose(1, 2)   # [G, S, k, E]
    keep = masks * (pos < cap)                                        # overflow dropped
    kept = keep.sum(-1)                                               # [G, S, k]
    slot = F.one_hot((pos * keep).sum(-1), cap)                       # [G, S, k, C]
    dispatch = (keep.unsqueeze(-1) * slot.unsqueeze(-2)).sum(2).to(probs.dtype)                  # [G, S, E, C]
    combine = ((keep * top_p.unsqueeze(-1)).unsqueeze(-1) * slot.unsqueeze(-2)).sum(2)          # [G, S, E, C]
    return dispatch, combine, kept


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e * P_e per group, averaged over groups (f: share of first choices, P: mean prob)."""
    e = probs.shape[-1]
    frac = F.one_hot(first_choice, e).to(probs.dtype).mean(1)         # [G, E]
    return (frac * probs.mean(1)).sum(-1).mean() * e


class Experts(nn.Module):
    """E independent two-layer MLPs as batched weights [E, ...]: [E, G, C, d] -> [E, G, C, d].

    Its boundary is where the plan turns G-split tokens into E-split ones and back (`ep_plan`)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, d, h = cfg.n_expert, cfg.n_embd, cfg.expert_hidden
        self.w1 = nn.Parameter(torch.randn(e, d, h) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(e, 1, h))
        self.w2 = nn.Parameter(torch.randn(e, h, d) * (0.02 / math.sqrt(2 * cfg.n_layer)))
        self.b2 = nn.Parameter(torch.zeros(e, 1, d))

    def forward(self, x: torch.Tensor, counts: Optional[torch.Tensor] = None, index: Optional[torch.Tensor] = None,
                back: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Capacity: x [E, G, C, d]. Dropless: x [G, S, d] tokens, counts [G, E], index [G, R] the token of each
        of a group's rows sorted by expert, back [G, R] the sorted row of each choice: -> [G, R, d] by choice."""
        if counts is not None:
            rows, routing = by_expert(x, counts, self.w1, index)     # [G*R, d], expert-major (ragged)
            h = F.gelu(grouped_linear(rows, self.w1, self.b1, routing))
            return by_group(grouped_linear(h, self.w2, self.b2, routing), routing, back)
        e, g, c, d = x.shape
        h = F.gelu(torch.bmm(x.reshape(e, g * c, d), self.w1) + self.b1)
        return (torch.bmm(h, self.w2) + self.b2).reshape(e, g, c, d)


class MoE(nn.Module):
    """GShard/Switch MoE layer: router, capacity dispatch, experts, weighted combine.

    forward(x [B, T, d]) -> (y [B, T, d], aux loss); dropped tokens give 0 here (the block's residual
    carries them). `last_kept` holds the last call's [G, S, k] kept choices (routing decisions)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = Experts(cfg)
        self.last_kept: Optional[torch.Tensor] = None
        self.last_choice: Optional[torch.Tensor] = None   # dropless: the last call's [G, S, k] experts chosen

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        s = self.cfg.group_size or t
        if (b * t) % s:
            raise ValueError(f"MoE: {b * t} tokens do not cut into groups of group_size={s}")
        tokens = x.reshape(b * t // s, s, d)                          # [G, S, d]
        probs = self.gate(tokens).softmax(-1)                         # [G, S, E]
        if self.cfg.dropless:
            return self.dropless(tokens, probs).reshape(b, t, d), load_balancing_loss(probs, probs.argmax(-1))
        dispatch, combine, kept = top_k_gating(probs, self.cfg.top_k, capacity(self.cfg, s), self.cfg.normalize_top_k)
        self.last_kept = kept.detach()
        aux = load_balancing_loss(probs, probs.argmax(-1))
        expert_in = torch.einsum("gsec,gsd->egcd", dispatch, tokens)  # [E, G, C, d]: split G -> split E
        expert_out = self.experts(expert_in)                          # [E, G, C, d]: split E -> split G
        y = torch.einsum("gsec,egcd->gsd", combine, expert_out)
        return y.reshape(b, t, d), aux


    def dropless(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Every choice of every token computed: [G, S, d] -> [G, S, d]. Works along each group's dims only."""
        g, s, d = tokens.shape
        k, e = self.cfg.top_k, self.cfg.n_expert
        top_p, top_i = probs.topk(k, dim=-1)                          # [G, S, k]
        if self.cfg.normalize_top_k and k > 1:
            top_p = top_p / top_p.sum(-1, keepdim=True)
        self.last_kept, self.last_choice = torch.ones_like(top_i).detach(), top_i.detach()
        ids = top_i.reshape(g, s * k)                                 # choice j of token i at i*k + j
        order = ids.argsort(dim=1, stable=True)                       # each group's choices by expert
        counts = F.one_hot(ids, e).sum(1)                             # [G, E]
        # the rows are gathered (tokens by `order`) and put back in choice order inside the dispatch and combine
        out = self.experts(tokens, counts, order // k, order.argsort(dim=1))   # [G, S*k, d], choice order
        return (out * top_p.reshape(g, s * k, 1)).reshape(g, s, k, d).sum(2)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.moe = nn.LayerNorm(cfg.n_embd), MoE(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x))
        return x + y, aux


class MoEGPT(GPT):
    """nanoGPT's shape with every MLP an MoE layer; the loss adds aux_loss_coef x the layers' aux losses.

    GPT's embeddings, tied head and initialisation, except that the attention's output projections keep
    the plain 0.02 (the experts' second layer is drawn smaller in `Experts` instead)."""
    block = MoEBlock
    scaled_init = ""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x, auxes = self.embed(idx), []
        for block in self.blocks:
            x, a = block(x)
            auxes.append(a)
        aux = torch.stack(auxes).sum()  # not 0.0 + ...: a constant added to a Partial sum forces its reduction
        if targets is None:
            return self.output(x, None)
        logits, ce = self.output(x, targets)
        return logits, ce + self.cfg.aux_loss_coef * aux


def ep_plan(expert_axis: int, ndim: int, tensor_axis: Optional[int] = None, dropless: bool = False) -> dict:
    """Expert parallelism on mesh axis `expert_axis` (GShard; DeepSpeed-MoE's EP x DP when the batch
    is also split on that axis, the other axes replicating the experts as data parallelism does).

    Expert weights `[E, ...]` are `S(0)` on the expert axis and Broadcast elsewhere. The experts'
    input is converted to E-split (from the G-split the router leaves: the dispatch all-to-all) and
    their output back to G cut as their input arrived (`gt.ragged(1)`: the combine all-to-all; G is
    ragged where groups smaller than a sequence meet a batch that does not divide over the ranks);
    the backward runs the duals, one all-to-all each. Other mesh axes are left as the tokens arrive. Every other weight (router,
    attention, embeddings) is Broadcast: data parallel.

    With `tensor_axis` (EP x TP), each expert is also split Megatron-style on that axis (w1 and b1
    column-parallel on the hidden dim, w2 row-parallel: at most one all-reduce of the experts' output
    forward and of their input gradient backward, on the tensor axis; the planner turns the forward's
    into a reduce-scatter, the combine all-to-all of half the tensor and an all-gather, which moves
    less); tokens are then Broadcast on the tensor axis. `moe_gpt_plan` adds tensor parallelism for the rest of the model.

    `dropless=True` (for `MoEConfig(dropless=True)`): the experts placed, nothing else; the dispatch
    and combine are `by_expert` / `by_group`, which read the expert axis off the weights' layout. With
    `tensor_axis` the same Megatron split of each expert: `grouped_linear` reads column- and row-parallel
    off the weights' splits, reduces the second layer's Partial rows once on the tensor axis (forward)
    and `by_expert`'s backward the first layer's input gradient once; the rows are whole on that axis.
    """
    def on_axes(e, t=Broadcast()):
        return tuple(e if a == expert_axis else t if a == tensor_axis else Broadcast() for a in range(ndim))

    def hint(e, t=None):
        return tuple(e if a == expert_axis else t if a == tensor_axis else None for a in range(ndim))
    if tensor_axis is not None and tensor_axis == expert_axis:
        raise ValueError(f"ep_plan: tensor_axis={tensor_axis} is the expert axis; give another mesh axis")
    if dropless and tensor_axis is None:
        return {"*experts.*": on_axes(Split(0))}
    if dropless:
        return {"*experts.w1": on_axes(Split(0), Split(2)), "*experts.b1": on_axes(Split(0), Split(2)),
                "*experts.w2": on_axes(Split(0), Split(1)), "*experts.b2": on_axes(Split(0))}
    if tensor_axis is None:
        return {"*experts.*": on_axes(Split(0)),
                "*experts": ModuleLayout(input=hint(Split(0)), output=hint(Ragged(1)))}
    return {"*experts.w1": on_axes(Split(0), Split(2)), "*experts.b1": on_axes(Split(0), Split(2)),
            "*experts.w2": on_axes(Split(0), Split(1)), "*experts.b2": on_axes(Split(0)),
            "*experts": ModuleLayout(input=hint(Split(0), Broadcast()), input_grad=hint(None, Broadcast()),
                                     output=hint(Split(1), Broadcast()))}


def moe_gpt_plan(expert_axis: int, ndim: int, tensor_axis: Optional[int] = None, *, zero: bool = False,
                 reshard_after_forward: bool = True, dropless: bool = False) -> dict:
    """`MoEGPT`'s plan: `ep_plan` for the experts, and with `tensor_axis` (EP x TP) attention and the
    tied embedding tensor-parallel as `models/gpt.py`'s `tp_plan` has them (its MLP entries dropped:
    the MoE layers replace the MLPs).

    `zero=True` (DeepSpeed-MoE with ZeRO): every dense parameter is stored `S(0)` on the expert axis
    (which is then also the data axis) and gathered per block while it runs, as `zero_plan` does;
    the experts are already split on that axis and are used where they are stored (their module
    names its own `params=`, so a block's gather leaves them out).
    """
    if zero and tensor_axis is not None:
        raise ValueError("moe_gpt_plan: zero=True with tensor_axis is not built; give one of them")
    plan = {} if tensor_axis is None else {k: v for k, v in tp_plan(tensor_axis, ndim).items() if ".mlp" not in k}
    plan.update(ep_plan(expert_axis, ndim, tensor_axis, dropless))
    if zero:
        on_axis = lambda s: tuple(s if a == expert_axis else Broadcast() for a in range(ndim))  # noqa: E731
        keep = lambda s: tuple(s if a == expert_axis else None for a in range(ndim))  # noqa: E731
        hint = ModuleLayout(params=keep(Broadcast()), reshard_after_forward=reshard_after_forward)
        experts = plan.get("*experts")   # dropless: no boundary hint, the ragged ops move the rows
        edges = {} if experts is None else dict(input=experts.input, output=experts.output)
        plan.update({"*": on_axis(Split(0)), "": hint, "blocks.*": hint,
                     "*experts": ModuleLayout(**edges, params=keep(Split(0)))})
    return plan


def ep_batch(ndim: int, tensor_axis: Optional[int] = None) -> tuple:
    """The batch split over every mesh axis but the tensor axis (EP x DP: each rank routes its own
    tokens; EP x TP: the ranks of a tensor group route the same ones)."""
    return tuple(Broadcast() if a == tensor_axis else Split(0) for a in range(ndim))
