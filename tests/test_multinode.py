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
