"""torch's operator database on global tensors and on DTensor, side by side (issue 34).

    python bench/op_db.py                 # the table: every op_db entry, S(0) over 4 ranks, up to 3 samples
    python bench/op_db.py --json out.json # and every entry's outcome
    python bench/op_db.py --only add,mul  # only the entries whose names contain one of these (a quick check)

Each OpInfo entry (float32, CPU; its function variant) runs its first samples with every tensor
argument split on dim 0 over 4 ranks (Broadcast where it has no dim 0), gathered and compared with
plain torch (tests/op_db_sweep.py, forward only, as the issue's table). globaltensor runs on its
simulator; DTensor runs as its own op test runs it with `LocalTensorMode` (4 simulated ranks on torch's
fake process group), each tensor `distribute_tensor(t, mesh, [Shard(0)])` (Replicate where no dim 0).
Columns: equal with no fallback (native), equal only through the replicated fallback (globaltensor
only: DTensor has none), wrong value or shape, error.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import op_db_sweep as sweep  # noqa: E402


def dtensor_outcome(entry: sweep.Entry, mesh: Any, samples: int = 3) -> str:
    """native / wrong / error / skip of `entry` on DTensor (Shard(0) over the mesh), against one device."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    def rank0(x: Any) -> Any:
        if isinstance(x, DTensor):
            x = x.full_tensor()
        if isinstance(x, LocalTensor):
            x = x._local_tensors[0]
        return x.detach().resolve_conj().resolve_neg() if isinstance(x, torch.Tensor) else x

    ran = 0
    for sample in sweep.sample_inputs(entry, False, samples):
        try:
            want, _, _ = sweep.run_plain(entry, sample, False, 0)
        except Exception:
            continue
        values = sweep.deterministic(entry, sample)
        try:
            with LocalTensorMode(frozenset(range(mesh.size()))):
                def conv(t: torch.Tensor) -> Any:
                    return distribute_tensor(t.detach().clone(), mesh, [Shard(0)] if t.dim() else [Replicate()])
                inp, args, kwargs = pytree.tree_map_only(torch.Tensor, conv, (sample.input, sample.args, sample.kwargs))
                torch.manual_seed(0)
                got = pytree.tree_map(rank0, entry.fn(inp, *args, **kwargs))
        except Exception:
            return sweep.ERROR
        ran += 1
        want = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, want)
        diff = (sweep.difference(got, want, "out") if values else
                sweep.difference(sweep.shapes_of(got), sweep.shapes_of(want), "out"))
        if diff is not None:
            return sweep.WRONG
    return sweep.NATIVE if ran else sweep.SKIP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write every entry's outcome here")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--only", help="comma-separated parts of entry names: run only the entries containing one")
    a = ap.parse_args()
    entries = [e for e in sweep.entries() if not e.inplace]
    if a.only:
        parts = a.only.split(",")
        entries = [e for e in entries if any(p in e.key for p in parts)]
    t0, c0 = time.time(), time.process_time()
    ours = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e in entries:
            ours[e.key] = sweep.sweep(e, sweep.LAYOUTS["1d4"], grad=False, samples=a.samples)
    t_ours, c_ours = time.time() - t0, time.process_time() - c0

    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.tensor import init_device_mesh
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    from torch.distributed._local_tensor import LocalTensorMode
    with LocalTensorMode(frozenset(range(4))):
        mesh = init_device_mesh("cpu", (4,))
    t0, c0 = time.time(), time.process_time()
    theirs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e in entries:
            theirs[e.key] = dtensor_outcome(e, mesh, a.samples)
    t_theirs, c_theirs = time.time() - t0, time.process_time() - c0

    counted = [k for k in ours if ours[k].status != sweep.SKIP and theirs[k] != sweep.SKIP]
    ours_c = collections.Counter(ours[k].status for k in counted)
    theirs_c = collections.Counter(theirs[k] for k in counted)
    fallen = collections.Counter(f for k in counted for f in ours[k].fallbacks)
    print(f"op_db entries (float32, CPU, function variants), both run: {len(counted)} "
          f"(skipped: torch runs no sample, or a jiterator)")
    print("| | equal, no fallback | equal through the replicated fallback | wrong value or shape | error |")
    print("|---|---|---|---|---|")
    print(f"| globaltensor | {ours_c[sweep.NATIVE]} | {ours_c[sweep.FALLBACK]} | {ours_c[sweep.WRONG]} | "
          f"{ours_c[sweep.ERROR]} |")
    print(f"| DTensor | {theirs_c[sweep.NATIVE]} | - | {theirs_c[sweep.WRONG]} | {theirs_c[sweep.ERROR]} |")
    print(f"native: globaltensor {ours_c[sweep.NATIVE] / len(counted):.1%}, DTensor "
          f"{theirs_c[sweep.NATIVE] / len(counted):.1%}; distinct aten ops falling back: {len(fallen)}")
    print(f"sweep time: globaltensor {t_ours:.0f} s wall / {c_ours:.0f} s CPU, "
          f"DTensor {t_theirs:.0f} s wall / {c_theirs:.0f} s CPU")
    for k in counted:
        if ours[k].status in (sweep.WRONG, sweep.ERROR):
            print(f"  globaltensor {ours[k]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: {"ours": ours[k].status, "fallbacks": ours[k].fallbacks, "detail": ours[k].detail,
                           "dtensor": theirs[k]} for k in ours}, f, indent=1)


if __name__ == "__main__":
    main()
