"""A GPT training step side by side: globaltensor vs the same model under torch DTensor.

    python bench/train_step.py           # TP=2 on 2 gloo processes, DP=2 x TP=2 on 4
    python bench/train_step.py --quick   # a smoke run: tiny model, a few steps

One step = forward + backward + AdamW step (foreach, same hyper-parameters) on
`models/gpt.py`'s GPT, built on every rank from the same seed and fed the same
batches. The two implementations run interleaved step by step (A B A B ...) in
one launch, each step between barriers; a step's time is the slowest rank's.

- globaltensor: `gt.to_global(model, placement, tp_plan(...))`, batch laid out
  with `dp_batch(...)` (or Broadcast for TP alone); the unchanged optimizer
  reduces the Partial gradients over the data axis.
- DTensor: `parallelize_module` on the "tp" axis of a ("dp", "tp") DeviceMesh:
  ColwiseParallel q/k/v/fc, RowwiseParallel proj; each attention's n_head set to
  n_head // tp and its views written with local sizes (the standard recipe);
  vocab-parallel tied embedding (RowwiseParallel on wte, ColwiseParallel head
  with Shard(-1) logits, the tie restored after parallelising) and
  `loss_parallel()` cross-entropy, so both sides shard the embedding/head the
  same way. For DP each rank takes its slice of the batch and the gradients are
  all-reduced over the "dp" group in one flat buffer (as DDP's bucket would).

Peak memory is measured in a separate launch per implementation (so the two do
not share an allocator): each rank resets its RSS high-water mark
(/proc/self/clear_refs) after start-up, builds the model and optimizer and runs
a few steps; reported is VmHWM minus the RSS right before building, max over
ranks. It therefore counts parameters, gradients, AdamW state, activations and
the allocator's slack, not just live tensors.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import types
import warnings
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import globaltensor as gt
from common import agree_on_failures, attempt, build_and_time, paired_ratio, write_results
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan

IMPLS = ("globaltensor", "DTensor")


# ---------------------------------------------------------------- data and memory

def batches(cfg: GPTConfig, batch: int, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable synthetic text: each row counts up by a per-row stride from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(cfg.block_size + 1)) % cfg.vocab_size
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------- the two implementations

class Trainer:
    """One implementation: `step(idx, tgt)` trains one step and keeps the loss (detached, not synced)."""
    losses: list

    def loss_values(self) -> list[float]:
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Local bytes of parameters + gradients + optimizer state on this rank."""
        raise NotImplementedError


class GlobalTensorTrainer(Trainer):
    def __init__(self, cfg: GPTConfig, dp: int, tp: int, lr: float, seed: int) -> None:
        if dp == 1:
            self.p = gt.placement("cpu", list(range(tp)))
            plan, self.batch_sbp = tp_plan(0, 1), (gt.broadcast,)
        else:
            self.p = gt.placement("cpu", np.arange(dp * tp).reshape(dp, tp).tolist())
            plan, self.batch_sbp = tp_plan(1, 2), dp_batch(0, 2)
        torch.manual_seed(seed)
        self.model = GPT(cfg)
        gt.to_global(self.model, self.p, plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=True)
        self.losses = []

    def step(self, idx: torch.Tensor, tgt: torch.Tensor) -> None:
        idx, tgt = gt.to_global(idx, self.p, self.batch_sbp), gt.to_global(tgt, self.p, self.batch_sbp)
        _, loss = self.model(idx, tgt)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.losses.append(loss.detach())

    def loss_values(self) -> list[float]:
        return [x.full_tensor().item() for x in self.losses]

    def state_bytes(self) -> int:
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        n = 0
        for p in self.model.parameters():
            n += 2 * local(p).nbytes  # parameter + gradient
            n += sum(local(v).nbytes for v in self.opt.state[p].values() if torch.is_tensor(v) and v.dim())
        return n


def _local_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward with local sizes: q/k/v give this rank's n_head // tp heads."""
    b, t, _ = x.shape
    heads = lambda y: y.view(b, t, self.n_head, y.shape[-1] // self.n_head).transpose(1, 2)  # noqa: E731
    q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       dropout_p=self.dropout if self.training else 0.0)
    return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class DTensorTrainer(Trainer):
    def __init__(self, cfg: GPTConfig, dp: int, tp: int, lr: float, seed: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       loss_parallel, parallelize_module)
        self.DTensor, self.loss_parallel = DTensor, loss_parallel
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        self.dp, self.dp_rank = dp, mesh.get_local_rank("dp")
        self.dp_group = mesh.get_group("dp") if dp > 1 else None
        torch.manual_seed(seed)
        self.model = model = GPT(cfg)
        plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                        use_local_output=False)}
        for i, blk in enumerate(model.blocks):
            assert blk.attn.n_head % tp == 0, "n_head must divide by tp"
            blk.attn.n_head //= tp
            blk.attn.forward = types.MethodType(_local_attention_forward, blk.attn)
            plan.update({f"blocks.{i}.attn.q": ColwiseParallel(), f"blocks.{i}.attn.k": ColwiseParallel(),
                         f"blocks.{i}.attn.v": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                         f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
        parallelize_module(model, mesh["tp"], plan)
        model.head.weight = model.wte.weight  # parallelize_module distributes each use separately; re-tie
        params = list(model.parameters())
        self.params = params
        dts = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        # two groups: a foreach kernel takes DTensors or plain tensors, not a mix
        self.opt = torch.optim.AdamW([{"params": dts}, {"params": plain}], lr=lr, foreach=True)
        self.losses = []

    def step(self, idx: torch.Tensor, tgt: torch.Tensor) -> None:
        if self.dp > 1:
            rows = idx.shape[0] // self.dp
            sl = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
            idx, tgt = idx[sl], tgt[sl]
        with self.loss_parallel():
            _, loss = self.model(idx, tgt)
            self.opt.zero_grad()
            loss.backward()
        if self.dp > 1:
            grads = [p.grad.to_local() if isinstance(p.grad, self.DTensor) else p.grad for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.dp
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        self.opt.step()
        self.losses.append(loss.detach())

    def loss_values(self) -> list[float]:
        local = torch.stack([x.to_local() if isinstance(x, self.DTensor) else x for x in self.losses])
        if self.dp > 1:
            dist.all_reduce(local, group=self.dp_group)
            local /= self.dp
        return local.tolist()

    def state_bytes(self) -> int:
        local = lambda t: t.to_local() if isinstance(t, self.DTensor) else t  # noqa: E731
        n = 0
        for p in self.params:
            n += 2 * local(p).nbytes
            n += sum(local(v).nbytes for v in self.opt.state[p].values() if torch.is_tensor(v) and v.dim())
        return n


BUILDERS = {"globaltensor": GlobalTensorTrainer, "DTensor": DTensorTrainer}


# ---------------------------------------------------------------- rank bodies

def timed(cfg: GPTConfig, dp: int, tp: int, batch: int, reps: int, warmup: int, lr: float, seed: int,
          threads: int):
    """Build both, check a first step on both, then time interleaved steps; rank 0 returns the results."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    data = batches(cfg, batch, 1 + warmup + reps)
    live, times, errors = build_and_time({k: partial(BUILDERS[k], cfg, dp, tp, lr, seed) for k in IMPLS}, data,
                                         reps, warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = paired_ratio(times, "globaltensor", "DTensor") if len(times) == 2 else None
    losses = {k: t.loss_values() for k, t in live.items()}
    state: list = [None] * dist.get_world_size()
    dist.all_gather_object(state, {k: t.state_bytes() for k, t in live.items()})
    if dist.get_rank() != 0:
        return None
    return {"median_s": med, "paired_ratio": ratio, "losses": losses, "errors": errors,
            "state_bytes": {k: max(s[k] for s in state) for k in live}}


def peak_memory(impl: str, cfg: GPTConfig, dp: int, tp: int, batch: int, steps: int, lr: float, seed: int,
                threads: int):
    """Peak RSS growth while building `impl` and running `steps` steps; max over ranks (rank 0 returns)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    data = batches(cfg, batch, steps)
    dist.barrier()
    _reset_peak()
    base = _status("VmRSS")
    errors: dict[str, str] = {}
    t = attempt(errors, impl, BUILDERS[impl], cfg, dp, tp, lr, seed)
    errors = agree_on_failures(errors)
    for i in range(steps):
        if errors:
            break
        attempt(errors, impl, t.step, *data[i])
        errors = agree_on_failures(errors)
    peak = _status("VmHWM") - base
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peak)
    if dist.get_rank() != 0:
        return None
    return {"error": errors.get(impl), "peak_bytes": max(gathered), "per_rank": gathered}


# ---------------------------------------------------------------- driver and report

def run_config(name: str, dp: int, tp: int, cfg: GPTConfig, args) -> dict:
    n = dp * tp
    res = {"config": name, "dp": dp, "tp": tp, "ranks": n}
    try:
        res.update(gt.launch(timed, n, backend="gloo",
                             args=(cfg, dp, tp, args.batch, args.reps, args.warmup, args.lr, args.seed,
                                   args.threads))[0])
    except Exception as e:  # noqa: BLE001
        res.update({"median_s": {}, "losses": {}, "state_bytes": {},
                    "errors": {k: f"launch failed: {type(e).__name__}: {e}" for k in IMPLS}})
    res["memory"] = {}
    for impl in IMPLS:
        try:
            res["memory"][impl] = gt.launch(peak_memory, n, backend="gloo",
                                            args=(impl, cfg, dp, tp, args.batch, args.mem_steps, args.lr, args.seed,
                                                  args.threads))[0]
        except Exception as e:  # noqa: BLE001
            res["memory"][impl] = {"error": f"launch failed: {type(e).__name__}: {e}", "peak_bytes": None}
    return res


def _mib(b) -> str:
    return "—" if b is None else f"{b / 2**20:.1f}"


def report(results: list[dict], cfg: GPTConfig, args) -> str:
    head = (f"Training step, GPT (n_layer {cfg.n_layer}, n_embd {cfg.n_embd}, n_head {cfg.n_head}, "
            f"block {cfg.block_size}, vocab {cfg.vocab_size}), global batch {args.batch}, fp32, AdamW foreach; "
            f"{args.threads} torch thread(s) per rank; "
            f"gloo on {platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}; "
            f"medians of {args.reps} interleaved steps after {args.warmup + 1} warm-up; gt / DTensor: median of per-step ratios")
    lines = [head, "",
             "| config | ranks | globaltensor ms/step | DTensor ms/step | gt / DTensor | "
             "gt peak RSS growth MiB/rank | DTensor peak RSS growth | gt param+grad+Adam MiB/rank | "
             "DTensor param+grad+Adam | max abs loss diff | gt final loss | DTensor final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in results:
        med, losses, errs, mem, st = r["median_s"], r["losses"], r["errors"], r["memory"], r["state_bytes"]

        def cell(k):
            return f"{med[k] * 1e3:.1f}" if k in med else "failed"
        ratio = f"{r['paired_ratio']:.2f}" if r.get("paired_ratio") is not None else "—"
        if len(losses) == 2:
            diff = max(abs(a - b) for a, b in zip(losses["globaltensor"], losses["DTensor"]))
            diff_s = f"{diff:.1e}"
        else:
            diff_s = "—"
        final = {k: f"{losses[k][-1]:.4f}" if k in losses else "—" for k in IMPLS}
        memc = {k: _mib(mem.get(k, {}).get("peak_bytes")) if not mem.get(k, {}).get("error") else "failed"
                for k in IMPLS}
        lines.append(f"| {r['config']} | {r['ranks']} | {cell('globaltensor')} | {cell('DTensor')} | {ratio} | "
                     f"{memc['globaltensor']} | {memc['DTensor']} | {_mib(st.get('globaltensor'))} | "
                     f"{_mib(st.get('DTensor'))} | {diff_s} | {final['globaltensor']} | {final['DTensor']} |")
        for k, e in errs.items():
            notes.append(f"- {r['config']} {k}: failed: {e}")
        for k in IMPLS:
            e = mem.get(k, {}).get("error")
            if e:
                notes.append(f"- {r['config']} {k} (memory run): failed: {e}")
    lines += ["", "Step = forward + backward + AdamW step (+ DP gradient all-reduce for DTensor), slowest rank. "
              "Peak RSS growth = VmHWM - VmRSS before building the model, in a separate launch per implementation "
              f"({args.mem_steps} steps), max over ranks; it includes allocator slack. "
              "param+grad+Adam = local bytes of those tensors, max over ranks. "
              "Loss diff = max over steps of |loss_gt - loss_DTensor| (same seed, same batches)."]
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def print_losses(results: list[dict]) -> None:
    for r in results:
        ls = r["losses"]
        if not ls:
            continue
        print(f"\nlosses, {r['config']} (step: " + ", ".join(ls) + ")")
        for i, vals in enumerate(zip(*ls.values())):
            print(f"  {i:3d}: " + "  ".join(f"{v:.6f}" for v in vals))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads per rank (torchrun's default OMP_NUM_THREADS=1; "
                         "more oversubscribes the cores once there are several ranks)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        args.reps, args.warmup, args.mem_steps = 3, 1, 2
        args.n_embd, args.block, args.vocab, args.batch = 32, 16, 64, 4
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    results = [run_config("TP=2", 1, 2, cfg, args), run_config("DP=2 x TP=2", 2, 2, cfg, args)]
    print_losses(results)
    text = report(results, cfg, args)
    print()
    print(text)
    if not args.quick:
        write_results(args.out, "train_step", text, {"config": vars(cfg), "args": vars(args), "results": results})
