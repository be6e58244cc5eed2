"""Train models/gpt.py with torch.optim.AdamW on a data x tensor mesh (Megatron TP + DP as SBPs only).

    python examples/train_gpt.py                         # 4 simulated ranks, 2x2 mesh
    python examples/train_gpt.py --backend gloo --mesh 2x1
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh 2x2
    python examples/train_gpt.py --device cuda           # the simulated ranks share one GPU
    torchrun --nproc-per-node 1 examples/train_gpt.py --mesh 1x1 --device cuda   # nccl
    python examples/train_gpt.py --steps 5 --save ckpt   # checkpoints in ckpt/step-000005 (DCP)
    python examples/train_gpt.py --steps 10 --resume ckpt --mesh 1x2   # steps 5..9, any mesh
"""
import argparse
import os
import warnings

import numpy as np
import torch

import globaltensor as gt
from globaltensor import checkpoint as gtc
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan


def main(mesh: tuple, steps: int, device: str = "cpu", save: str | None = None, resume: str | None = None,
         save_every: int = 0) -> list:
    warnings.simplefilter("ignore")  # fallback warnings are counted in gt.stats()
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    p = gt.placement(device, np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())
    gt.to_global(model, p, tp_plan(tensor_axis=1, ndim=2))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
    idx = gt.to_global(data[:, :-1], p, dp_batch(data_axis=0, ndim=2))
    tgt = gt.to_global(data[:, 1:], p, dp_batch(data_axis=0, ndim=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lines, start, pending = [], 0, None
    if resume:  # the last complete checkpoint, whatever mesh saved it: model and AdamW state reshard on load
        last = gtc.latest(resume)
        if last is None:
            raise FileNotFoundError(f"--resume {resume}: no complete checkpoint under it")
        start = gtc.load_training(last, model, opt)
        lines.append(f"resumed from {last} at step {start}")
    for step in range(start, steps):
        with gt.comm_log() as log:
            _, loss = model(idx, tgt)
            opt.zero_grad()
            loss.backward()
            opt.step()
        value = loss.full_tensor().item()
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(log.summary().items()) if v)
        lines.append(f"step {step:3d}  loss {value:.4f}  received {log.recv_bytes} B ({kinds})")
        if save and (step + 1 == steps or save_every and (step + 1) % save_every == 0):
            if pending is not None:  # one upload at a time
                pending.result()
            # async under torchrun/gloo (training goes on while DCP writes); synchronous on the simulator
            pending = gtc.save_training(os.path.join(save, f"step-{step + 1:06d}"), model, opt, step + 1,
                                        async_save=True)
    if pending is not None:
        pending.result()
    return lines


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
    ap.add_argument("--resume", metavar="DIR", help="continue from the last complete checkpoint under DIR")
    args = ap.parse_args()
    try:
        mesh = parse_mesh(args.mesh)
    except argparse.ArgumentTypeError as e:
        ap.error(f"argument --mesh: {e}")
    if args.steps < 1:
        ap.error(f"argument --steps: expected a positive int, got {args.steps}")
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) != mesh[0] * mesh[1]:
        ap.error(f"argument --mesh: {args.mesh} has {mesh[0] * mesh[1]} ranks but torchrun started "
                 f"{os.environ.get('WORLD_SIZE')} (--nproc-per-node); make them agree")
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        out = main(mesh, args.steps, args.device, args.save, args.resume, args.save_every)
        if gt.rank() == 0:
            print("\n".join(out))
    else:
        print(f"rank 0 of a {args.mesh} mesh ({args.backend}, {args.device}):")
        out = gt.launch(main, mesh[0] * mesh[1], backend=args.backend,
                        args=(mesh, args.steps, args.device, args.save, args.resume, args.save_every))
        print("\n".join(out[0]))
