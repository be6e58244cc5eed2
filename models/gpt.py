"""A small GPT written for one device (nanoGPT's shape), plus its parallel plans as SBPs only.

Nothing here communicates: `tp_plan` says which weights are split
(Megatron: q/k/v and fc column-parallel, proj rows; vocab-parallel tied
embedding), `sp_plan` and `ulysses_plan` where the sequence is split,
`dp_batch`/`seq_batch` how a batch is laid out; the dispatcher and boxing
derive every collective.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layout import Layout
from ..parallel.module import ModuleLayout
from ..sbp import Broadcast, Partial, Split


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    # the head's weight is the token embedding's (GPT-2); False gives the head its own weight, as a model split
    # by hand into pipeline stages must (torch.pipelining cannot tie across stages)
    tied_head: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        heads = lambda y: y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    block: type = Block                     # the layer (models/moe.py's MoEGPT: MoE blocks)
    scaled_init: str = "proj.weight"        # GPT-2's residual projections, drawn smaller ("": none)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(self.block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied_head:
            self.head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if self.scaled_init and name.endswith(self.scaled_init):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.output(x, targets)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def output(self, x: torch.Tensor, targets: torch.Tensor | None):
        """logits, or (logits, cross-entropy) with targets."""
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def tp_plan(tensor_axis: int, ndim: int) -> dict:
    """Megatron tensor parallelism on mesh axis `tensor_axis` (the other axes are left as they are).

    Weights: column-parallel q/k/v/fc (weight [out, in] split on out, bias split), row-parallel
    proj (weight split on in), vocab-parallel tied embedding/head; they never move.
    Activations, as Megatron keeps them: the residual stream is Broadcast on the tensor axis.
    A row-parallel output (and the vocab-parallel embedding's) is Partial and all-reduced at once
    (`output=B`); a column-parallel region's input gradient is Partial and all-reduced once for the
    whole region (`input_grad=B` on `attn`, so q/k/v share one reduction of their summed gradients).
    """
    def on_axis(s):
        return tuple(s if a == tensor_axis else Broadcast() for a in range(ndim))

    def hint(s):
        return tuple(s if a == tensor_axis else None for a in range(ndim))
    col, row, rep = on_axis(Split(0)), on_axis(Split(1)), hint(Broadcast())
    return {"*.attn.q.*": col, "*.attn.k.*": col, "*.attn.v.*": col, "*.mlp.fc.*": col,
            "*.attn.proj.weight": row, "*.mlp.proj.weight": row, "wte.weight": col,
            "wte": ModuleLayout(output=rep),
            "*.attn": ModuleLayout(input_grad=rep), "*.mlp": ModuleLayout(input_grad=rep),
            "head": ModuleLayout(input_grad=rep),
            "*.attn.proj": ModuleLayout(output=rep), "*.mlp.proj": ModuleLayout(output=rep)}


def dp_batch(data_axis: int, ndim: int) -> tuple:
    """Data parallelism: the batch split on mesh axis `data_axis`, whole on the others."""
    return tuple(Split(0) if a == data_axis else Broadcast() for a in range(ndim))


def sp_plan(tensor_axis: int, ndim: int) -> dict:
    """Megatron sequence parallelism (Korthikanti et al.) on mesh axis `tensor_axis`: `tp_plan`'s weights, with
    the activations outside the tensor-parallel regions split on the sequence (`S(1)` of [batch, seq, hidden])
    instead of whole, so norms, dropout and the residual stream hold 1/t of them.

    Each region's input is all-gathered on entry (`input=B`; the gradient's dual is a reduce-scatter) and
    each row-parallel output is reduce-scattered to the sequence split (`output=S(1)`; an all-gather of its
    gradient): TP's all-reduces become reduce-scatter + all-gather of the same bytes. The vocab-parallel
    embedding's output stays Partial (`output=P`) until the position embedding is added, and `drop` takes
    the sum split (one reduce-scatter, as Megatron scatters after the embedding): the position embedding's
    gradient is then whole on every rank, not partial. Norm weights are Broadcast over a sequence split, so
    their gradients are Partial and reduced with the gradient bucket. Composes with `dp_batch` on the
    other axes (the batch comes in whole on the tensor axis).
    """
    def hint(s):
        return tuple(s if a == tensor_axis else None for a in range(ndim))
    seq, rep = hint(Split(1)), hint(Broadcast())
    plan = tp_plan(tensor_axis, ndim)
    plan.update({"wte": ModuleLayout(output=hint(Partial("sum"))), "drop": ModuleLayout(input=seq),
                 "*.attn": ModuleLayout(input=rep), "*.mlp": ModuleLayout(input=rep), "head": ModuleLayout(input=rep),
                 "*.attn.proj": ModuleLayout(output=seq), "*.mlp.proj": ModuleLayout(output=seq)})
    return plan


def ulysses_plan(seq_axis: int, ndim: int, *, heads_at_linears: bool = True) -> dict:
    """DeepSpeed-Ulysses on mesh axis `seq_axis`: every activation split on the sequence, weights whole; around
    attention the split moves from the sequence to the heads and back, one all-to-all per tensor.

    q, k and v leave their linears split on the hidden dim (`output=S(2)` of [batch, seq, hidden], which the
    head view makes a heads split): an all-to-all each, whose backward is the dual all-to-all of the
    gradient, so nothing is redone. The attention's output comes back to the sequence split at `proj`'s
    input (`input=S(1)`). Per layer and rank: 4 all-to-alls forward and 4 backward, (n-1)/n^2 of the
    activation each; heads must divide the axis. The position embedding is sliced to the rank's
    positions (`output=S(0)` of [seq, hidden]: an all-gather of its gradient, which then needs no
    reduction). Parameters are Broadcast, so every gradient is Partial over the axis and reduced in the
    gradient bucket, as data parallelism's. The batch comes in split on the sequence (`seq_batch`).

    `heads_at_linears=False` leaves q, k and v split on the sequence into attention, whose rule then
    decides (`gt.attention_method`, or the cost): Ulysses there is the same all-to-alls, converted by the
    dispatcher (the attention keeps the converted q, k, v for its backward; the backward converts their
    gradients once), and ring attention runs with the same plan.

    The sequence split must survive the linears' flattening of [batch, seq] into one dim: it does when
    each rank holds one sequence (the batch whole on the axis is 1, or split down to one per rank by
    `data_axis`), as long-sequence training runs.
    """
    def hint(s):
        return tuple(s if a == seq_axis else None for a in range(ndim))
    plan = {"*.attn.proj": ModuleLayout(input=hint(Split(1))), "wpe": ModuleLayout(output=hint(Split(0)))}
    if heads_at_linears:
        heads = ModuleLayout(output=hint(Split(2)))
        plan.update({"*.attn.q": heads, "*.attn.k": heads, "*.attn.v": heads})
    return plan


def seq_batch(seq_axis: int, ndim: int, data_axis: int | None = None) -> tuple:
    """A [batch, seq] batch split on the sequence on mesh axis `seq_axis` (and on the batch on `data_axis`)."""
    return tuple(Split(1) if a == seq_axis else Split(0) if a == data_axis else Broadcast() for a in range(ndim))


def zero_plan(data_axis: int, ndim: int, tensor_axis: int | None = None, *, reshard_after_forward: bool = True,
              param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> dict:
    """ZeRO on mesh axis `data_axis` (FSDP's grouping: each block, and the rest at the root), alone or
    composed with `tp_plan` on `tensor_axis` (FSDP + TP).

    Every parameter is stored split over the data axis on the first dim that tensor parallelism leaves
    whole (so the data split never nests inside the tensor split, which would not be one all-gather),
    and used Broadcast on the data axis while its module runs. A parameter that tensor parallelism
    splits on its only dim (a column-parallel bias) stays Broadcast on the data axis: its gradient is
    all-reduced with its module's bucket, as data parallelism does. `reshard_after_forward=False` is
    ZeRO-2; `param_dtype`/`reduce_dtype` are mixed precision.
    """
    tp = {} if tensor_axis is None else tp_plan(tensor_axis, ndim)
    use = tuple(Broadcast() if a == data_axis else None for a in range(ndim))
    hint = ModuleLayout(params=use, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype)

    def stored(tensor_split: Split | None, dims: int):
        free = [d for d in range(dims) if tensor_split is None or d != tensor_split.dim]
        data = Split(free[0]) if free else Broadcast()
        return tuple(data if a == data_axis else (tensor_split or Broadcast()) if a == tensor_axis else Broadcast()
                     for a in range(ndim))

    plan: dict = {}
    for pattern, value in tp.items():  # tensor-parallel parameters: the data split on another dim
        if isinstance(value, ModuleLayout):
            continue
        split = value[tensor_axis]
        plan[pattern] = stored(split if isinstance(split, Split) else None, 1 if pattern.endswith("bias") else 2)
    if tensor_axis is not None:  # patterns like "*.attn.q.*" cover weight and bias: split them by name
        for pattern in [p for p in plan if p.endswith(".*")]:
            split = tp[pattern][tensor_axis]
            plan[pattern[:-1] + "weight"] = stored(split, 2)
            plan[pattern[:-1] + "bias"] = stored(split, 1)
            del plan[pattern]
    plan["*"] = stored(None, 1)
    plan.update({k: v for k, v in tp.items() if isinstance(v, ModuleLayout)})
    plan.update({"": hint, "blocks.*": hint})
    return plan


def _axes(sbp, ndim: int) -> tuple:
    """A `params=` hint as one entry per mesh axis (a single SBP stands for a 1-D mesh's tuple)."""
    if isinstance(sbp, Layout):
        sbp = sbp.sbp
    return tuple(sbp) if isinstance(sbp, (tuple, list)) else (sbp,) * ndim


def pp_plan(stages: list, n_layer: int, inner: dict | None = None, virtual: int = 1, tied_head: bool = True) -> dict:
    """Pipeline stages as placements: blocks split evenly (earlier stages take the extra ones), the
    embeddings on the first stage, the final norm on the last, and the head, whose weight is the
    embedding's, used on the last stage (moved there once per `gt.Pipeline` step, its gradient summed
    over the micro-batches sent back and added to the embedding's: one parameter, a Partial across the
    two placements).

    `virtual`: chunks per stage, for the interleaved schedule: the blocks split evenly into
    `len(stages) * virtual` chunks, chunk c on stage c mod len(stages) (Megatron's virtual stages).

    `tied_head=False` (a `GPTConfig(tied_head=False)` model): the head's own weight is stored on the last stage
    and never moves.

    `inner`: a plan for each stage's own mesh (e.g. `tp_plan(1, 2)` with data x tensor stages, or
    `zero_plan(...)`): its SBP entries are placed on the stage that owns the parameter; its module hints
    apply as they are (the head's merged with the move to the last stage). The head takes the tied
    weight in the layout (and dtypes) of the hint that gathers it on the first stage (ZeRO's root:
    Broadcast on the data axis), so with ZeRO it is gathered once per step with the move, as the
    embedding's group uses it, rather than used split and all-gathered by each matmul.
    """
    inner = dict(inner or {})
    first, last = stages[0], stages[-1]
    bcast = (Broadcast(),) * first.ndim

    chunks = len(stages) * virtual
    if not isinstance(virtual, int) or virtual < 1 or virtual > 1 and n_layer < chunks:
        raise ValueError(f"pp_plan(virtual=): {virtual!r} chunks on each of {len(stages)} stages need at least "
                         f"{len(stages)} x virtual blocks, the model has {n_layer}")

    def stage_of_layer(i: int) -> object:
        return stages[min(i * chunks // n_layer, chunks - 1) % len(stages)]

    sbps = {k: v for k, v in inner.items() if not isinstance(v, ModuleLayout)}
    hints = {k: v for k, v in inner.items() if isinstance(v, ModuleLayout)}

    def sbp_for(name: str) -> tuple:
        for pattern, sbp in sbps.items():
            if fnmatch.fnmatchcase(name, pattern):
                return sbp if isinstance(sbp, tuple) else (sbp,)
        return bcast

    plan: dict = {}
    names = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    names += [f"blocks.{i}.{rest}" for i in range(n_layer) for rest in
              ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.q.weight", "attn.q.bias",
               "attn.k.weight", "attn.k.bias", "attn.v.weight", "attn.v.bias", "attn.proj.weight",
               "attn.proj.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias")]
    for name in names:
        where = (first if name.startswith(("wte", "wpe")) else last if name.startswith("ln_f") else
                 stage_of_layer(int(name.split(".")[1])))
        plan[name] = Layout(where, sbp_for(name))
    head = hints.pop("head", None)
    head_fields = {} if head is None else {f: getattr(head, f) for f in ("input", "input_grad", "output",
                                                                          "output_grad")}
    if not tied_head:
        plan["head.weight"] = Layout(last, sbp_for("head.weight"))
        if head_fields:
            plan["head"] = ModuleLayout(**head_fields)
        plan.update(hints)
        return plan
    # the tied weight is used on the last stage as the module that gathers it on the first stage uses it
    # (the innermost of "wte" and its ancestors with a `params=` hint: ZeRO's root, Broadcast on the data
    # axis), so the head gathers it once per step with the move, not each matmul at each use
    owner = next((hints[k] for k in ("wte", "") if k in hints and hints[k].params is not None), None)
    stored = sbp_for("wte.weight")
    use = stored if owner is None else tuple(s if h is None else h for h, s in zip(_axes(owner.params, len(stored)),
                                                                                   stored))
    dtypes = {} if owner is None else {"param_dtype": owner.param_dtype, "reduce_dtype": owner.reduce_dtype}
    plan["head"] = ModuleLayout(params=Layout(last, use), reshard_after_forward=False, **dtypes, **head_fields)
    plan.update(hints)
    return plan
