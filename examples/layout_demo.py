"""Lay one tensor out on a 2x2 mesh in several ways and look at each rank's shard.

    python examples/layout_demo.py                      # 4 simulated ranks in this process
    python examples/layout_demo.py --backend gloo       # 4 gloo processes
    torchrun --nproc-per-node 4 examples/layout_demo.py # the same program under torchrun
"""
import argparse
import os

import torch

import globaltensor as gt


def main() -> str:
    mesh = gt.placement("cpu", [[0, 1], [2, 3]])
    t = torch.arange(30.0).reshape(5, 6)  # 5 rows over 2 ranks: uneven on purpose
    lines = []
    for sbp in [(gt.split(0), gt.split(1)), (gt.split(0), gt.split(0)), (gt.broadcast, gt.split(1)),
                (gt.partial_sum, gt.split(0))]:
        x = gt.to_global(t, mesh, sbp)
        local = x.to_local()
        with gt.comm_log() as log:
            assert torch.equal(x.full_tensor(), t)
        lines.append(f"rank {gt.rank()} {str(sbp):>14}: local {tuple(local.shape)} "
                     f"rows {local[:, 0].tolist() if local.numel() else []}; full_tensor received {log.recv_bytes} B")
    # uneven shards from each rank, global shape discovered with one small collective
    y = gt.from_local(torch.ones(2 - gt.rank() % 2, 2), gt.placement("cpu", [0, 1]), gt.split(0))
    lines.append(f"rank {gt.rank()} from_local of uneven shards: global shape {tuple(y.shape)}")
    return "\n".join(lines)


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        print(main())
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("--backend", default="sim", choices=["sim", "gloo"])
        args = ap.parse_args()
        for text in gt.launch(main, 4, backend=args.backend):
            print(text)
