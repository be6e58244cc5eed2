"""Train models/gpt.py with torch.optim.AdamW on a data x tensor mesh (Megatron TP + DP as SBPs only).

    python examples/train_gpt.py                         # 4 simulated ranks, 2x2 mesh
    python examples/train_gpt.py --backend gloo --mesh 2x1
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh 2x2
    python examples/train_gpt.py --device cuda           # the simulated ranks share one GPU
    torchrun --nproc-per-node 1 examples/train_gpt.py --mesh 1x1 --device cuda   # nccl
    python examples/train_gpt.py --steps 5 --save ckpt   # checkpoints in ckpt/step-000005 (DCP)
    python examples/train_gpt.py --steps 10 --resume ckpt --mesh 1x2   # steps 5..9, any mesh
    python examples/train_gpt.py --check --report        # compare with one device; where the bytes go, per module

It says what it does: the mesh and what each axis carries, parameters per rank, loss, tokens/s and
bytes received per step, where those bytes go (forward, backward, optimizer step), and with
`--check` how far it is from the same training on one device, computed in the same run.
"""
import argparse
import contextlib
import os
import signal
import time
import warnings

import numpy as np
import torch

import globaltensor as gt
from globaltensor import checkpoint as gtc
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan


CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH = 8
SEQUENCES = 32  # 4 batches an epoch, shuffled per epoch: a resumed job must find its place in them
SEED = 0


class Tokens(torch.utils.data.Dataset):
    """Token sequences as (input, target) pairs: the target is the input shifted by one."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, CFG.vocab_size, (SEQUENCES, CFG.block_size + 1), generator=g)

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, i: int) -> tuple:
        return self.rows[i, :-1], self.rows[i, 1:]


def _epochs(batches: gt.data.Batches):
    """Batches, one epoch after another (a training loop counts steps, not epochs)."""
    while True:
        yield from batches


def one_device(steps: int) -> tuple:
    """The same training on one device (same seed, data and optimizer): losses and final parameters."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data, losses = Tokens(), []
    per_epoch = SEQUENCES // BATCH
    for step in range(steps):  # the order gt.data.Batches reads on any mesh
        rows = gt.data.batch_indices(SEQUENCES, BATCH, SEED, step // per_epoch, step % per_epoch)
        _, loss = model(data.rows[rows, :-1], data.rows[rows, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: q.detach() for n, q in model.named_parameters()}


def describe(mesh: tuple, p: gt.Placement, model: torch.nn.Module, backend: str) -> list:
    """What each mesh axis carries, and how the parameters are spread."""
    axes = [f"axis 0 (size {mesh[0]}): data parallel, DP={mesh[0]}: the batch split, gradients all-reduced "
            "once per step in one bucket",
            f"axis 1 (size {mesh[1]}): tensor parallel, TP={mesh[1]}: Megatron column/row-parallel attention "
            "and MLP, vocab-parallel embedding; activations all-reduced at layer ends"]
    axes = [a + (" (size 1: unused)" if n == 1 else "") for a, n in zip(axes, mesh)]
    total = sum(q.numel() for q in model.parameters())
    mine = sum(q.to_local().numel() for q in model.parameters())
    return [f"mesh {mesh[0]}x{mesh[1]} {p.ranks} ({backend}, {p.device_type}); pipeline (PP) and experts (EP): none",
            *(f"  {a}" for a in axes),
            f"GPT {CFG.n_layer} layers, n_embd {CFG.n_embd}, vocab {CFG.vocab_size}: {total} parameters, "
            f"{mine} on rank {gt.rank()} ({mine / total:.0%})"]


def main(mesh: tuple, steps: int, device: str = "cpu", save: str | None = None, resume: str | None = None,
         save_every: int = 0, check: bool = False, report: bool = False, backend: str = "sim",
         trace: str | None = None, kill: tuple | None = None) -> list:
    warnings.simplefilter("ignore")  # fallback warnings are counted in gt.stats()
    cfg = CFG
    reference = one_device(steps) if check and gt.rank() == 0 else None
    torch.manual_seed(0)
    model = GPT(cfg)
    p = gt.placement(device, np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())
    gt.to_global(model, p, tp_plan(tensor_axis=1, ndim=2))
    # each rank reads its rows of each global batch; the position is saved with each checkpoint
    batches = gt.data.Batches(Tokens(), BATCH, p, dp_batch(data_axis=0, ndim=2), seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lines, start, pending = describe(mesh, p, model, backend), 0, None
    losses, rep = [], None
    if resume:  # the last complete checkpoint, whatever mesh saved it: model and AdamW state reshard on load
        last = gtc.latest(resume)
        if last is None:  # a job's first start: one command line starts it and restarts it (torchrun --max-restarts)
            lines.append(f"--resume {resume}: no complete checkpoint yet; starting at step 0")
        else:
            start = gtc.load_training(last, model, opt, data=batches)
            lines.append(f"resumed from {last} at step {start}")
    stream = _epochs(batches)
    for step in range(start, steps):
        if kill == (gt.rank(), step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank, as a node failure loses it: no exit handler runs
        idx, tgt = next(stream)
        t0 = time.perf_counter()
        with gt.comm_log() as log, (gt.comm_report(model) if step == steps - 1 else _nothing()) as last:
            _, loss = model(idx, tgt)
            opt.zero_grad()
            loss.backward()
            opt.step()
        value = loss.full_tensor().item()
        took = time.perf_counter() - t0
        rep = last or rep
        losses.append(value)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(log.summary().items()) if v)
        lines.append(f"step {step:3d}  loss {value:.4f}  {BATCH * cfg.block_size / took:8.0f} tokens/s  "
                     f"received {log.recv_bytes} B ({kinds})")
        if save and (step + 1 == steps or save_every and (step + 1) % save_every == 0):
            if pending is not None:  # one upload at a time
                pending.result()
            # async under torchrun/gloo (training goes on while DCP writes); synchronous on the simulator
            pending = gtc.save_training(os.path.join(save, f"step-{step + 1:06d}"), model, opt, step + 1,
                                        data=batches, async_save=True)
    if pending is not None:
        pending.result()
    if rep is not None:
        phases = {"forward": "forward", "backward": "backward", "outside": "optimizer step"}
        where = ", ".join(f"{phases[c]} {sum(b for m, b in rep.by_module(c).items())} B" for c in phases)
        top = sorted(((b, m) for m, b in rep.by_module().items()), reverse=True)[:3]
        lines.append(f"where the bytes of the last step go (rank {gt.rank()}): {where}; most: "
                     + ", ".join(f"{_NAMES.get(m, m)} {b} B" for b, m in top))
        if report:
            lines.append(rep.tree())
        if trace:  # every rank's collectives of the last step and the compute between them, one file
            rep.chrome_trace(trace, all_ranks=True)
            lines.append(f"chrome trace of the last step: {trace} (open in chrome://tracing or ui.perfetto.dev)")
    if check:
        full = {n: q.full_tensor().cpu() for n, q in model.named_parameters()}  # every rank takes part; the reference ran on the CPU
        if reference is not None:
            ref_losses, ref_params = reference
            dl = max(abs(a - b) for a, b in zip(losses, ref_losses[start:]))
            dp = max((full[n] - ref_params[n]).abs().max().item() for n in ref_params)
            verdict = "matches one device (float32 rounding)" if dl < 1e-4 and dp < 1e-4 else "DIFFERS from one device"
            lines.append(f"check against one device, {steps} steps: max |loss diff| {dl:.1e}, "
                         f"max |parameter diff| {dp:.1e}: {verdict}")
    return lines


_NAMES = {"": "<root> (the loss)", "(outside modules)": "gradient bucket (optimizer step)"}


@contextlib.contextmanager
def _nothing():
    yield None


def parse_mesh(text: str) -> tuple:
    """`--mesh DATAxTENSOR` as (data, tensor); an argparse error names the argument and the accepted form."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        hint = f"; {text} ranks as a 1-D mesh is {text}x1 (data) or 1x{text} (tensor)" if text.isdigit() else ""
        raise argparse.ArgumentTypeError(f"expected DATAxTENSOR, two positive ints joined by 'x' (2x2, 1x2, 2x1), "
                                         f"got {text!r}{hint}")
    return int(parts[0]), int(parts[1])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sim", choices=["sim", "gloo", "nccl"])
    ap.add_argument("--mesh", default="2x2", help="data x tensor, e.g. 2x2, 1x2, 2x1")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the placement's device type")
    ap.add_argument("--save", metavar="DIR", help="checkpoint (torch.distributed.checkpoint) into DIR/step-N")
    ap.add_argument("--save-every", type=int, default=0, metavar="N", help="also every N steps (default: at the end)")
    ap.add_argument("--resume", metavar="DIR", help="continue from the last complete checkpoint under DIR (from step 0 "
                    "where there is none yet)")
    ap.add_argument("--check", action="store_true", help="also train on one device and print the difference")
    ap.add_argument("--kill-rank-at", metavar="RANK:STEP", help="fault injection under torchrun: SIGKILL rank RANK "
                    "as it starts step STEP, in the first attempt only (try --max-restarts with --resume)")
    ap.add_argument("--report", action="store_true", help="print the last step's per-module communication report")
    ap.add_argument("--trace", metavar="FILE", help="write the last step's chrome trace (all ranks) to FILE")
    args = ap.parse_args()
    try:
        mesh = parse_mesh(args.mesh)
    except argparse.ArgumentTypeError as e:
        ap.error(f"argument --mesh: {e}")
    if args.steps < 1:
        ap.error(f"argument --steps: expected a positive int, got {args.steps}")
    if args.check and args.resume:
        ap.error("argument --check: compares a whole run from step 0 with one device; drop --resume")
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) != mesh[0] * mesh[1]:
        ap.error(f"argument --mesh: {args.mesh} has {mesh[0] * mesh[1]} ranks but torchrun started "
                 f"{os.environ.get('WORLD_SIZE')} (--nproc-per-node); make them agree")
    kill = None
    if args.kill_rank_at:
        try:
            kill = tuple(int(v) for v in args.kill_rank_at.split(":"))
            assert len(kill) == 2
        except (ValueError, AssertionError):
            ap.error(f"argument --kill-rank-at: expected RANK:STEP, two ints (1:3), got {args.kill_rank_at!r}")
        if "RANK" not in os.environ:
            ap.error("argument --kill-rank-at: kills a torchrun worker process; run under torchrun")
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        out = main(mesh, args.steps, args.device, args.save, args.resume, args.save_every, args.check,
                   args.report, os.environ.get("GT_BACKEND", "torchrun"), args.trace, kill)
        if gt.rank() == 0:
            print("\n".join(out))
    else:
        print(f"rank 0 of a {args.mesh} mesh ({args.backend}, {args.device}):")
        out = gt.launch(main, mesh[0] * mesh[1], backend=args.backend,
                        args=(mesh, args.steps, args.device, args.save, args.resume, args.save_every, args.check,
                              args.report, args.backend, args.trace))
        print("\n".join(out[0]))
