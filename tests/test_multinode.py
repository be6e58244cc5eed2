"""Beyond one machine, on this one: two torchrun agents as two nodes (issue 37).

`torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`
started twice on this machine is a two-node job as a cluster runs one (c10d rendezvous, gloo across the
"nodes"). examples/train_gpt.py on its 2x2 mesh ([[0, 1], [2, 3]]: data across the nodes, tensor parallel
inside each) must train as the same job on one node does, and as one device does (`--check`), and every
worker must exit 0 (a process group left to the interpreter's teardown made some exit 1).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TRAIN = ["examples/train_gpt.py", "--mesh", "2x2", "--steps", "3"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nodes: int, per_node: int, args: list) -> list:
    """Start `nodes` torchrun agents of `per_node` workers each on this machine; their (returncode, output)."""
    port = _port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                               "--node-rank", str(n), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"gt-{port}", *args],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for n in range(nodes)]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, text))
    return out


def _losses(text: str) -> list:
    return [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", text, flags=re.M)]


@pytest.mark.gloo
def test_two_torchrun_agents_train_data_across_nodes_and_tensor_parallel_inside():
    two_nodes = _torchrun(2, 2, TRAIN + ["--check"])
    for rc, text in two_nodes:
        assert rc == 0, text[-3000:]
    head = two_nodes[0][1]  # node 0 holds global rank 0, which prints
    assert "matches one device" in head, head[-3000:]
    one_node = _torchrun(1, 4, TRAIN)
    assert one_node[0][0] == 0, one_node[0][1][-3000:]
    assert len(_losses(head)) == 3 and _losses(head) == _losses(one_node[0][1])  # the same job, the same sums
    sent = re.findall(r"received (\d+) B", head)
    assert sent and sent == re.findall(r"received (\d+) B", one_node[0][1])


def test_resume_from_a_directory_without_a_checkpoint_starts_the_job(tmp_path):
    """One command line starts a job and restarts it (`torchrun --max-restarts`): `--resume DIR` with nothing
    complete under DIR yet trains from step 0 (and saves there), then resumes from what it saved."""
    first = subprocess.run([sys.executable, "examples/train_gpt.py", "--mesh", "1x2", "--steps", "2", "--resume",
                            str(tmp_path), "--save", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no complete checkpoint yet; starting at step 0" in first.stdout
    again = subprocess.run([sys.executable, "examples/train_gpt.py", "--mesh", "1x2", "--steps", "3", "--resume",
                            str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 2" in again.stdout and len(_losses(again.stdout)) == 1


def _final_state(directory: Path) -> dict:
    """A DCP checkpoint read back in this process, as flat tensors (torch's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch
    out = directory.parent / (directory.name + ".pt")
    dcp_to_torch_save(str(directory), str(out))
    flat: dict = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            flat[prefix] = v
    walk("", torch.load(out, weights_only=False))
    return flat


@pytest.mark.gloo
@pytest.mark.slow  # ~70 s: two torchrun agents, a SIGKILL and a restart (issue 37's proof)
def test_a_killed_rank_restarts_and_resumes_to_the_uninterrupted_run(tmp_path):
    """torchrun --max-restarts 1 with rank 1 SIGKILLed as it starts step 3: the agent restarts both workers,
    which resume from the last complete checkpoint (model, AdamW state, step, RNG and the data position;
    saved asynchronously every step) and end at the same parameters and optimizer state as a run never
    interrupted, bit for bit; a checkpoint cut off by the kill is never taken as the latest. Then the job starts
    on 4 ranks (2x2) and resumes on 2 from their checkpoint (resharded by DCP), ending where the 2-rank run does,
    to float32 rounding. Each step reads another batch of a shuffled epoch (`gt.data.Batches`), so a resume that
    lost its place in the data would end elsewhere."""
    import torch
    common = ["examples/train_gpt.py", "--mesh", "2x1", "--steps", "6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def torchrun(procs: int, args: list, restarts: int = 0) -> str:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
                              "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                              f"127.0.0.1:{_port()}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=400)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        return out.stdout
    torchrun(2, common + ["--save", str(tmp_path / "whole")])
    killed = torchrun(2, common + ["--save", str(tmp_path / "killed"), "--save-every", "1", "--resume",
                                   str(tmp_path / "killed"), "--kill-rank-at", "1:3"], restarts=1)
    assert "resumed from" in killed, killed[-3000:]
    whole = _final_state(tmp_path / "whole" / "step-000006")
    again = _final_state(tmp_path / "killed" / "step-000006")
    assert whole.keys() == again.keys() and len(whole) > 10
    assert int(whole["data.epoch"]) == 1 and int(whole["data.batch"]) == 2  # 6 steps of 4-batch epochs
    # numpy's and Python's generators start from the OS's entropy in each process (two uninterrupted runs differ
    # there too) and the training draws from neither; torch's generator, the model and AdamW's state must agree
    kept = [k for k in whole if not k.startswith(("rng.numpy", "rng.python"))]
    assert any(k.startswith("rng") for k in kept), sorted(whole)
    for k in kept:
        assert torch.equal(whole[k], again[k]), k
    # 4 -> 2 ranks: the first three steps on a 2x2 mesh (data x tensor), the rest on two from that checkpoint
    torchrun(4, ["examples/train_gpt.py", "--mesh", "2x2", "--steps", "3", "--save", str(tmp_path / "moved")])
    torchrun(2, common + ["--resume", str(tmp_path / "moved"), "--save", str(tmp_path / "moved")])
    moved = _final_state(tmp_path / "moved" / "step-000006")
    for k in kept:
        # the key bias's gradient is zero up to rounding (softmax ignores a shift common to a row), which AdamW
        # divides by its own size: its value is rounding noise on any other reduction order (tests/test_cuda.py)
        if not k.startswith("rng") and not k.endswith("attn.k.bias"):
            torch.testing.assert_close(moved[k], whole[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.gloo
def test_a_hang_across_nodes_is_reported_naming_the_missing_rank_and_its_last_collective(tmp_path):
    """Rank 3 (on node 1) stops joining collectives. Within GT_HANG_SECONDS (5 here; 30 by default) the waiting
    ranks fail naming rank 3 and its last collective, and every rank, rank 3 included (its watcher is a thread
    of its own), has written its flight record: its last collectives, groups, call numbers and sizes."""
    import json
    import time
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GT_HANG_SECONDS": "5", "GT_HANG_REPORT_DIR": str(tmp_path)}
    port = _port()
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "--rdzv-id", f"hang-{port}", "tests/jobs/hang.py"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    outs = [p.communicate(timeout=200)[0] for p in procs]
    took = time.monotonic() - t0
    assert any(p.returncode != 0 for p in procs)
    text = "\n".join(outs)
    # named by a rank that waits on rank 3 itself (one held up by another waiting rank leaves it to that one),
    # with what rank 3 did last: its watcher answers while its main thread sleeps
    assert re.search(r"hang: rank [012] has waited \d+ s in \w+ #\d+ on group \([0-3, ]+\) \[.*\], which rank\(s\) 3 "
                     r"never joined \(rank 3: \d+ s since it left \w+ #\d+ on group", text), text[-3000:]
    assert took < 100, took  # reported, not waited out (gloo's own timeout is 300 s; rank 3 sleeps 120 s)
    # and what rank 3 is doing now, from its stack: the program's line it sleeps on
    assert re.search(r"rank 3: .*?; now at \S*hang\.py:13 in <module>", text), text[-3000:]
    for r in range(4):
        record = json.loads((tmp_path / f"gt-flight-rank{r}.json").read_text())
        assert record["doing"]["at"].split(" in ")[0].endswith("hang.py:" + ("13" if r == 3 else "14")), record
        assert record["rank"] == r and record["recent"] and record["recent"][0]["kind"] in ("all_reduce",
                                                                                           "reduce_scatter")
