"""One MoE layer (models/moe.py, top-2, capacity) forward + backward on gloo processes, side by side.

    python bench/moe.py             # E = 4 and 8 on 4 gloo processes
    python bench/moe.py --quick     # a smoke run

Every implementation runs the same layer (same seed, same tokens, same routing code `route`) and is
timed interleaved in one launch (each call between barriers, a fresh random order per repetition; a
call's time is its slowest rank's):

- gt EP: `gt.to_global(layer, placement, ep_plan(0, 1))`, tokens `S(0)`: the dispatch and combine are
  the planner's S(G) <-> S(E) all-to-alls, one each way, forward and backward.
- gt replicated: the same layer with every weight Broadcast (data parallelism): each rank runs all E
  experts on its own tokens (the same FLOPs as EP) and, at the default sizes, moves nothing in forward
  + backward: its expert gradients are Partial, left to data parallelism's all-reduce after the step
  (2 (n-1)/n of the experts' weights; not timed here). With few tokens (`--quick`) the cost model
  instead all-to-alls the activations to compute the weight gradients split on E, which moves less
  than reducing [E, d, h] gradients would (its bytes are measured, like EP's).
- a2a floor: hand-written torch on local tensors: route locally, `all_to_all_single` (differentiable,
  `torch.distributed.nn.functional`) of the dispatched [E, G/n, C, d] to [E/n, G, C, d], experts,
  `all_to_all_single` back, combine. What any EP layer must do.
- all-gather (DTensor style): every rank all-gathers all tokens, routes all of them, runs its E/n
  experts, and the partial outputs are summed back to each rank's tokens (an all-reduce on gloo, which
  has no reduce-scatter; counted below as the reduce-scatter a bandwidth-optimal backend would run).

Dropless (`MoEConfig(dropless=True)`, every choice computed, the rows ragged per expert), the same
tokens and weights:

- gt dropless: `ep_plan(0, 1, dropless=True)`: `gt.by_expert` (the count all-gather, one uneven
  all-to-all of exactly the routed rows), `gt.grouped_linear` twice, `gt.by_group` (the all-to-all
  back); the backward the two all-to-alls reversed.
- dropless floor: hand-written Megatron-style on local tensors: sort the rank's k*T choices by expert,
  count them, exchange the counts (`all_to_all_single` of [E] int64), `all_to_all_single` of the sorted
  rows with uneven splits, sort the arrivals by local expert, one matmul per local expert (the same
  loop as `grouped_linear`: `torch._grouped_mm` takes no fp64 and wants 16-byte strides on CPU), the
  all-to-all back, unsort, gate-weighted sum of each token's k outputs.
- all-gather dropless (DTensor style): every rank all-gathers all tokens, routes them all, runs its
  experts on the rows that chose them, and the partial outputs are summed back to each rank's tokens.

Each call is also charged its process CPU time summed over the ranks (the "CPU" column and ratios):
on a shared 2-core VM other sessions' load moves the wall time of a call by tens of percent, the CPU
it used far less.

Bytes received per rank for forward + backward: gt's counted by `gt.comm_log()`; the others worked
out from their collectives (all-to-all (n-1)/n of the local part; all-gather and reduce-scatter
(n-1)/n of the whole token tensor each, forward and again backward; the dropless floor's from its
actual split sizes: the counts, then the routed rows received, twice forward and twice backward).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn

import globaltensor as gt
from common import interleaved_times, paired_ratio, paired_ratio_ci, write_results
from globaltensor.models.moe import MoE, MoEConfig, capacity, ep_plan, top_k_gating

IMPLS = ("gt EP", "a2a floor", "all-gather", "gt replicated", "gt dropless", "dropless floor", "all-gather dropless")
DROPLESS = ("gt dropless", "dropless floor", "all-gather dropless")
PAIRS = (("gt EP", "a2a floor"), ("gt EP", "all-gather"), ("gt EP", "gt replicated"), ("a2a floor", "all-gather"),
         ("gt dropless", "dropless floor"), ("gt dropless", "all-gather dropless"), ("gt dropless", "all-gather"),
         ("gt dropless", "gt EP"), ("dropless floor", "all-gather dropless"))


def layer_and_tokens(cfg: MoEConfig, tokens_per_rank: int, n: int, seed: int):
    torch.manual_seed(seed)
    layer = MoE(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n * tokens_per_rank // cfg.block_size, cfg.block_size, cfg.n_embd, generator=g)
    w = torch.randn(x.shape, generator=g)
    return layer, x, w


class GlobalTensorLayer:
    def __init__(self, cfg: MoEConfig, tokens_per_rank: int, seed: int, experts_split: bool) -> None:
        n = dist.get_world_size()
        layer, x, w = layer_and_tokens(cfg, tokens_per_rank, n, seed)
        p = gt.placement("cpu", list(range(n)))
        self.layer = gt.to_global(layer, p, ep_plan(0, 1, dropless=cfg.dropless) if experts_split else {})
        self.x = gt.to_global(x, p, gt.split(0)).requires_grad_(True)
        self.w = gt.to_global(w, p, gt.split(0))
        self.bytes = 0

    def step(self) -> None:
        with gt.comm_log() as log:
            y, aux = self.layer(self.x)
            ((y * self.w).sum() + aux).backward()
        self.bytes = log.recv_bytes
        self.y = y.detach().to_local()
        self.x.grad = None
        for q in self.layer.parameters():
            q.grad = None


class LocalShards:
    """The layer's weights and tokens as one rank of a hand-written implementation holds them: the
    router whole, its E/n experts, its G/n groups."""

    def __init__(self, cfg: MoEConfig, tokens_per_rank: int, seed: int, kind: str) -> None:
        self.n, self.r, self.kind, self.cfg = dist.get_world_size(), dist.get_rank(), kind, cfg
        layer, x, w = layer_and_tokens(cfg, tokens_per_rank, self.n, seed)
        ge = cfg.n_expert // self.n
        self.first = self.r * ge
        mine = slice(self.first, self.first + ge)
        ex = layer.experts
        self.gate = layer.gate.weight.detach().clone().requires_grad_(True)
        self.w1, self.b1, self.w2, self.b2 = (t.detach()[mine].clone().requires_grad_(True)
                                              for t in (ex.w1, ex.b1, ex.w2, ex.b2))
        g_r = x.shape[0] // self.n
        self.x = x[self.r * g_r:(self.r + 1) * g_r].clone().requires_grad_(True)
        self.w = w[self.r * g_r:(self.r + 1) * g_r].clone()
        self.numel, self.item = x.numel(), x.element_size()

    def backward(self, y: torch.Tensor, aux: torch.Tensor) -> None:
        """The same loss as the gt layers' (the aux loss of the local groups: the global mean's scale
        does not change the time), its backward, and the gradients dropped."""
        self.y = y.detach()
        ((y * self.w).sum() + aux / self.n).backward()
        self.x.grad = None
        for q in (self.gate, self.w1, self.b1, self.w2, self.b2):
            q.grad = None


class TorchLayer(LocalShards):
    """Plain tensors on each rank: the hand-written all-to-all floor, or the all-gather style."""

    def __init__(self, cfg: MoEConfig, tokens_per_rank: int, seed: int, kind: str) -> None:
        super().__init__(cfg, tokens_per_rank, seed, kind)
        g_r, item = self.x.shape[0], self.item
        c = capacity(cfg, cfg.block_size)
        if kind == "a2a floor":   # [E, G/n, C, d] local, (n-1)/n of it per all-to-all, 2 forward + 2 backward
            self.bytes = 4 * (self.n - 1) * cfg.n_expert * g_r * c * cfg.n_embd * item // self.n
        else:                     # all-gather + reduce-scatter of [G, S, d] forward, and again backward
            self.bytes = 4 * (self.n - 1) * self.numel * item // self.n

    def experts(self, h: torch.Tensor) -> torch.Tensor:
        e, g, c, d = h.shape
        h = torch.nn.functional.gelu(torch.bmm(h.reshape(e, g * c, d), self.w1) + self.b1)
        return (torch.bmm(h, self.w2) + self.b2).reshape(e, g, c, d)

    def routed(self, tokens: torch.Tensor):
        cfg = self.cfg
        probs = (tokens @ self.gate.t()).softmax(-1)
        dispatch, combine, _ = top_k_gating(probs, cfg.top_k, capacity(cfg, tokens.shape[1]), cfg.normalize_top_k)
        e = cfg.n_expert
        aux = (torch.nn.functional.one_hot(probs.argmax(-1), e).to(probs.dtype).mean(1) * probs.mean(1)).sum(-1)
        return dispatch, combine, aux.sum() * e

    def step(self) -> None:
        n, r = self.n, self.r
        if self.kind == "a2a floor":
            dispatch, combine, aux = self.routed(self.x)
            send = torch.einsum("gsec,gsd->egcd", dispatch, self.x).contiguous()      # [E, G/n, C, d]
            recv = dnn.all_to_all_single(torch.empty_like(send), send)                 # [n, E/n, G/n, C, d]
            e, g_r, c, d = send.shape
            h = recv.reshape(n, e // n, g_r, c, d).transpose(0, 1).reshape(e // n, n * g_r, c, d)
            out = self.experts(h).reshape(e // n, n, g_r, c, d).transpose(0, 1).contiguous().reshape(send.shape)
            back = dnn.all_to_all_single(torch.empty_like(out), out)                   # [E, G/n, C, d]
            y = torch.einsum("gsec,egcd->gsd", combine, back)
        else:
            parts = dnn.all_gather(self.x)                                              # every token everywhere
            tokens = torch.cat(parts)
            dispatch, combine, aux = self.routed(tokens)
            ge = self.cfg.n_expert // n
            mine = slice(r * ge, (r + 1) * ge)
            h = torch.einsum("gsec,gsd->egcd", dispatch[:, :, mine], tokens)
            y = torch.einsum("gsec,egcd->gsd", combine[:, :, mine], self.experts(h))   # partial: my experts
            g_r = self.x.shape[0]
            y = dnn.all_reduce(y)[r * g_r:(r + 1) * g_r]                                # sum, my tokens
        self.backward(y, aux)


class TorchDroplessLayer(LocalShards):
    """Plain tensors on each rank, dropless: the hand-written floor, or the all-gather style."""

    def __init__(self, cfg: MoEConfig, tokens_per_rank: int, seed: int, kind: str) -> None:
        super().__init__(cfg, tokens_per_rank, seed, kind)
        self.bytes = 0            # the floor's: from its split sizes, each step
        if kind == "all-gather dropless":  # all-gather + reduce-scatter of [G, S, d] forward, and again backward
            self.bytes = 4 * (self.n - 1) * self.numel * self.item // self.n

    def routed(self, tokens: torch.Tensor):
        """Top-k of every token: (gates [T*k], experts [T*k], aux), choice j of token i at i*k + j."""
        cfg = self.cfg
        probs = (tokens @ self.gate.t()).softmax(-1)                                   # [G, S, E]
        top_p, top_i = probs.topk(cfg.top_k, dim=-1)
        if cfg.normalize_top_k and cfg.top_k > 1:
            top_p = top_p / top_p.sum(-1, keepdim=True)
        e = cfg.n_expert
        aux = (torch.nn.functional.one_hot(probs.argmax(-1), e).to(probs.dtype).mean(1) * probs.mean(1)).sum(-1)
        return top_p.reshape(-1), top_i.reshape(-1), aux.sum() * e

    def experts(self, rows: torch.Tensor, per_expert: list) -> torch.Tensor:
        """One matmul per local expert on its contiguous rows (as `gt.grouped_linear`), both layers.

        Megatron's SequentialMLP: the rows `split` and the weights `unbind` per expert, whose backwards
        are a cat and a stack (indexing them, `rows[a:b]`, `w1[e]`, would zero-fill a whole-size
        gradient per expert and add them up: a slower floor than the one Megatron runs)."""
        parts = torch.split(rows, per_expert)
        weights = zip(self.w1.unbind(0), self.b1.unbind(0), self.w2.unbind(0), self.b2.unbind(0))
        return torch.cat([torch.addmm(b2, torch.nn.functional.gelu(torch.addmm(b1, r, w1)), w2)
                          for r, (w1, b1, w2, b2) in zip(parts, weights)])

    def step(self) -> None:
        n, k, e = self.n, self.cfg.top_k, self.cfg.n_expert
        tokens = self.x if self.kind == "dropless floor" else torch.cat(dnn.all_gather(self.x))
        d = tokens.shape[-1]
        flat = tokens.reshape(-1, d)
        gates, ids, aux = self.routed(tokens)
        if self.kind == "dropless floor":
            order = torch.argsort(ids, stable=True)                                    # the rank's choices by expert
            counts = torch.bincount(ids, minlength=e)                                  # [E]
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts)                                        # the count exchange
            ge = e // n
            send = counts.reshape(n, ge).sum(1).tolist()
            recv_counts = got.reshape(n, ge)                                           # [sender, local expert]
            recv = recv_counts.sum(1).tolist()
            rows = flat[order // k]
            arrived = dnn.all_to_all_single(rows.new_empty((sum(recv), d)), rows, recv, send)
            local_ids = torch.arange(ge).repeat(n).repeat_interleave(recv_counts.reshape(-1))
            by_expert = torch.argsort(local_ids, stable=True)                          # (sender, e) -> (e, sender)
            out = self.experts(arrived[by_expert], recv_counts.sum(0).tolist())
            back = out[torch.argsort(by_expert)]                                        # back to (sender, e)
            home = dnn.all_to_all_single(back.new_empty((sum(send), d)), back, send, recv)
            y = home[torch.argsort(order)] * gates.unsqueeze(-1)                       # choices in token order
            y = y.reshape(-1, k, d).sum(1).reshape(self.x.shape)
            own = counts[self.first:self.first + ge].sum().item()
            self.bytes = (e * (n - 1) // n * counts.element_size()
                          + 2 * (sum(recv) - own + sum(send) - own) * d * self.item)
        else:
            mine = (ids >= self.first) & (ids < self.first + e // n)
            sel = torch.nonzero(mine).squeeze(1)
            sel = sel[torch.argsort(ids[sel], stable=True)]
            out = self.experts(flat[sel // k], torch.bincount(ids[sel] - self.first, minlength=e // n).tolist())
            y = torch.zeros_like(flat).index_add(0, sel // k, out * gates[sel].unsqueeze(-1))
            g_r = self.x.shape[0]
            y = dnn.all_reduce(y.reshape(tokens.shape))[self.r * g_r:(self.r + 1) * g_r]   # sum, my tokens
        self.backward(y, aux)


def build(impl: str, cfg: MoEConfig, tokens: int, seed: int):
    dropless = MoEConfig(**{**cfg.__dict__, "dropless": True})
    if impl == "gt dropless":
        return GlobalTensorLayer(dropless, tokens, seed, experts_split=True)
    if impl in DROPLESS:
        return TorchDroplessLayer(dropless, tokens, seed, impl)
    if impl.startswith("gt"):
        return GlobalTensorLayer(cfg, tokens, seed, experts_split=impl == "gt EP")
    return TorchLayer(cfg, tokens, seed, impl)


def timed(cfg: MoEConfig, tokens: int, reps: int, warmup: int, seed: int, threads: int, impls: tuple = IMPLS):
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    layers = {k: build(k, cfg, tokens, seed) for k in impls}
    for t in layers.values():
        t.step()
    ref = {k: layers.get("gt dropless" if k in DROPLESS else "gt EP") for k in layers}   # the same layer?
    diffs = {k: (t.y - ref[k].y).abs().max().item() if ref[k] is not None else float("nan") for k, t in layers.items()}
    cpu: dict = {k: [] for k in layers}

    def counted(k: str, step):
        def fn() -> None:
            c0 = time.process_time()
            step()
            cpu[k].append(time.process_time() - c0)
        return fn
    times = interleaved_times({k: counted(k, t.step) for k, t in layers.items()}, reps, warmup)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (diffs, {k: v[warmup:] for k, v in cpu.items()}))
    if dist.get_rank() != 0:
        return None
    # CPU seconds of each call summed over the ranks: what the call cost the machine, which other
    # sessions' load on the shared cores changes far less than the wall time
    cpu_sum = {k: [sum(g[1][k][i] for g in gathered) for i in range(reps)] for k in impls}
    return {"times": times, "cpu": cpu_sum, "bytes": {k: t.bytes for k, t in layers.items()},
            "max_output_difference": {k: max(g[0][k] for g in gathered) for k in impls}}


def report(results: list[dict], args) -> str:
    lines = [f"One MoE layer, forward + backward, on {args.ranks} gloo processes ({platform.node()}, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}), fp32, top-2, capacity factor "
             f"{args.factor} (and dropless), d = {args.d}, expert hidden {args.hidden}, {args.tokens} tokens per rank in groups "
             f"of {args.group}; medians of {args.reps} interleaved calls after {args.warmup + 1} warm-up; ratios: "
             "medians of per-call ratios with ~95% intervals (wall time: the slowest rank's; CPU: process CPU "
             "time summed over the ranks)", ""]
    for res in results:
        t = res["times"]
        med = {k: statistics.median(v) for k, v in t.items()}
        diff = max(res["max_output_difference"].values())
        lines += [f"**E = {res['experts']}** (outputs agree to {diff:.1e}, each with its own kind's gt layer; "
                  f"dispatched [E, G, C, d] per rank: {res['dispatched']:,} bytes; capacity's ideal all-to-all bytes "
                  f"per rank, 2 forward + 2 backward: {res['ideal']:,}; dropless: the routed rows' bytes are the "
                  f"dropless floor's (rank 0's counts and rows, 2 forward + 2 backward))", "",
                  "| implementation | ms | CPU ms, all ranks | bytes recv/rank |", "|---|---|---|---|"]
        c = res.get("cpu", {})
        for k in res["times"]:
            cpu_ms = f"{statistics.median(c[k]) * 1e3:.1f}" if k in c else "-"
            lines.append(f"| {k} | {med[k] * 1e3:.1f} | {cpu_ms} | {res['bytes'][k]:,} |")
        lines.append("")
        for a, b in [(a, b) for a, b in PAIRS if a in t and b in t]:
            lo, hi = paired_ratio_ci(t, a, b)
            line = f"- {a} / {b}: {paired_ratio(t, a, b):.2f} ({lo:.2f}-{hi:.2f})"
            if a in c and b in c:
                clo, chi = paired_ratio_ci(c, a, b)
                line += f"; CPU {paired_ratio(c, a, b):.2f} ({clo:.2f}-{chi:.2f})"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--group", type=int, default=256, help="tokens per routing group")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--factor", type=float, default=1.25)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ", ".join(IMPLS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        args.reps, args.warmup, args.tokens, args.experts = 3, 0, 256, [4]
    impls = tuple(k.strip() for k in args.impls.split(","))
    unknown = [k for k in impls if k not in IMPLS]
    if unknown:
        ap.error(f"--impls: unknown {unknown}; choose from {', '.join(IMPLS)}")
    results = []
    for e in args.experts:
        cfg = MoEConfig(n_embd=args.d, expert_hidden=args.hidden, n_expert=e, top_k=2,
                        capacity_factor=args.factor, block_size=args.group)
        res = gt.launch(timed, args.ranks, backend="gloo", timeout=1800,
                        args=(cfg, args.tokens, args.reps, args.warmup, args.seed, args.threads, impls))[0]
        groups = args.ranks * args.tokens // args.group
        local = e * (groups // args.ranks) * capacity(cfg, args.group) * args.d * 4
        res.update(experts=e, dispatched=local, ideal=4 * (args.ranks - 1) * local // args.ranks)
        results.append(res)
    table = report(results, args)
    print(table)
    write_results(args.out, "moe", table, results)


if __name__ == "__main__":
    main()
