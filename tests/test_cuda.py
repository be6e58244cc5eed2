"""The CUDA paths: the simulator on "cuda" placements (its ranks share one GPU) and nccl with one rank.

Every test compares with the same program on "cpu" placements (or on one plain CUDA device), so
only the device changes. Skipped without a CUDA device: CI runs on CPU; run them on a GPU machine.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import globaltensor as gt
from boxing_support import make
from globaltensor.parallel import zero
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, pp_plan, tp_plan, zero_plan
from training import adamw_steps

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore:globaltensor. no SBP rule")]  # fallbacks are counted, not failures

S0, S1, B, P, PMAX = gt.split(0), gt.split(1), gt.broadcast, gt.partial_sum, gt.partial("max")
SOURCES = [(S0, S1), (S1, S0), (S0, S0), (S1, S1), (B, S0), (S0, B), (B, B), (P, S1), (S0, P), (P, P), (PMAX, B)]
TARGETS = [(S0, S1), (S1, S0), (S0, S0), (S1, S1), (B, S0), (S0, B), (B, B), (B, S1)]
MOVES = [  # (src ranks, src sbp, dst ranks, dst sbp): across placements, with ranks outside one or both
    ([[0, 1], [2, 3]], (S0, S1), [3, 1, 0], (S0,)),
    ([[0, 1], [2, 3]], (P, S1), [2, 3], (S1,)),
    ([0, 1], (S0,), [[2], [3]], (B, S1)),
    ([2, 3], (B,), [[0, 1], [2, 3]], (S1, S0)),
]
SHAPE = (5, 7)  # uneven on a 2x2 mesh


def _devices_and_values(ys) -> tuple:
    return [y.to_local().device.type for y in ys], [y.to_local().cpu() for y in ys]


def _conversions(device: str):
    """Every SOURCES -> TARGETS conversion on a 2x2 mesh, and MOVES; the results and bytes received."""
    square = gt.placement(device, [[0, 1], [2, 3]])
    ys, received = [], []
    for dtype in (torch.int64, torch.float32):
        for i, src in enumerate(SOURCES):
            for dst in TARGETS:
                x, _ = make(square, src, SHAPE, seed=i, dtype=dtype)
                with gt.comm_log() as log:
                    ys.append(x.to_global(square, dst))
                received.append(log.recv_bytes)
        for i, (rs, ss, rd, ds) in enumerate(MOVES):
            x, _ = make(gt.placement(device, rs), ss, SHAPE, seed=100 + i, dtype=dtype)
            with gt.comm_log() as log:
                ys.append(x.to_global(gt.placement(device, rd), ds))
            received.append(log.recv_bytes)
    return _devices_and_values(ys) + (received,)


def _grads(device: str):
    """The backward of boxing: each conversion's dual, on the source shards' device."""
    square = gt.placement(device, [[0, 1], [2, 3]])
    out = []
    for i, (ss, ds) in enumerate([((S0, S1), (S1, S0)), ((S0, S0), (B, B)), ((P, S1), (S0, B)), ((B, S0), (S1, S1))]):
        x, leaf = make(square, ss, SHAPE, seed=i, dtype=torch.float64, requires_grad=True)
        y = x.to_global(square, ds)
        w = gt.to_global(torch.arange(35.0, dtype=torch.float64).reshape(SHAPE), square, ds)
        (y * w).sum().backward()
        out.append(leaf.grad.cpu())
    return out


def test_sim_boxing_on_cuda_placements_matches_cpu():
    cuda = gt.launch(_conversions, 4, args=("cuda",))
    cpu = gt.launch(_conversions, 4, args=("cpu",))
    for r in range(4):
        devices, values, received = cuda[r]
        assert set(devices) == {"cuda"}, f"rank {r}: a result of a cuda placement is on {set(devices)}"
        assert received == cpu[r][2]
        for k, (a, b) in enumerate(zip(values, cpu[r][1])):
            assert torch.equal(a, b), f"rank {r}, conversion {k}"


def test_sim_boxing_gradients_on_cuda_match_cpu():
    for got, want in zip(gt.launch(_grads, 4, args=("cuda",)), gt.launch(_grads, 4, args=("cpu",))):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _stages(device: str):
    """Two stages on disjoint ranks ([0, 1] then [2, 3]): ranks outside an op's placement get empties."""
    s0, s1 = gt.placement(device, [0, 1]), gt.placement(device, [2, 3])
    torch.manual_seed(0)
    w0 = gt.to_global(torch.randn(6, 4), s0, (S1,)).requires_grad_()
    w1 = gt.to_global(torch.randn(4, 3), s1, (S0,)).requires_grad_()
    x = gt.to_global(torch.randn(5, 6), s0, (B,))
    h = torch.relu(x @ w0)
    y = h.to_global(s1, (B,)) @ w1
    loss = (y * y).sum()
    loss.backward()
    ts = [h, y, loss, w0.grad, w1.grad]
    return _devices_and_values(ts)


def test_sim_stages_on_disjoint_cuda_placements_match_cpu():
    for r, (got, want) in enumerate(zip(gt.launch(_stages, 4, args=("cuda",)), gt.launch(_stages, 4, args=("cpu",)))):
        assert set(got[0]) == {"cuda"}, f"rank {r}: {got[0]}"
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _random(seed_inside: bool):
    p = gt.placement("cuda", [[0, 1], [2, 3]])
    if seed_inside:
        torch.manual_seed(3)
    r = gt.randn(6, 5, placement=p, sbp=(S0, S1))
    d = torch.nn.functional.dropout(gt.ones(6, 5, placement=p, sbp=(B, S0)), 0.5)
    return r.full_tensor().cpu(), d.full_tensor().cpu()


@pytest.mark.parametrize("seed_inside", [True, False])
def test_sim_random_on_cuda_is_the_single_device_draw(seed_inside):
    torch.manual_seed(3)
    want = torch.randn(6, 5, device="cuda").cpu(), torch.nn.functional.dropout(torch.ones(6, 5, device="cuda"), 0.5)
    torch.manual_seed(3)  # each simulated rank starts from the caller's generator state (CUDA's too)
    for got in gt.launch(_random, 4, args=(seed_inside,)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1].cpu())


def test_sim_random_on_cuda_when_cuda_starts_inside_the_simulator():
    """In a fresh process CUDA starts inside the first simulated rank: the others still draw from the seed."""
    code = """if 1:
        import torch, globaltensor as gt
        torch.manual_seed(3)
        got = gt.launch(lambda: gt.randn(6, 5, placement=gt.placement("cuda", [0, 1, 2]), sbp=gt.split(0))
                        .full_tensor().cpu(), 3)
        torch.manual_seed(3)
        want = torch.randn(6, 5, device="cuda").cpu()
        assert all(torch.equal(g, want) for g in got), (got, want)
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
STEPS = 5


def _train(device: str, mesh=None, steps: int = STEPS):
    """models/gpt.py with AdamW: on one plain device (mesh None) or a data x tensor mesh of `device`."""
    torch.manual_seed(0)
    model = GPT(CFG)
    g = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g) for _ in range(2))
    if mesh is None:
        model.to(device)
        idx, tgt = idx.to(device), tgt.to(device)
    else:
        p = gt.placement(device, np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())
        gt.to_global(model, p, tp_plan(1, 2))
        idx, tgt = gt.to_global(idx, p, dp_batch(0, 2)), gt.to_global(tgt, p, dp_batch(0, 2))
    losses, params = adamw_steps(model, idx, tgt, steps, mesh is not None)
    devices = {(p.to_local() if mesh else p).device.type for p in model.parameters()}
    return losses, params, devices


def _assert_same_training(got, want, atol):
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=atol)
    for name, p in got[1].items():
        if not name.endswith("attn.k.bias"):  # its exact gradient is 0: AdamW amplifies the rounding noise
            torch.testing.assert_close(p, want[1][name], rtol=1e-4, atol=atol, msg=name)


@pytest.fixture(scope="module")
def cuda_reference():
    return _train("cuda")


@pytest.mark.parametrize("mesh", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_sim_gpt_training_on_cuda_matches_one_device_and_cpu(cuda_reference, mesh):
    cuda = gt.launch(_train, mesh[0] * mesh[1], args=("cuda", mesh))
    cpu = gt.launch(_train, mesh[0] * mesh[1], args=("cpu", mesh))
    for r in range(mesh[0] * mesh[1]):
        assert cuda[r][2] == {"cuda"} and cpu[r][2] == {"cpu"}
        _assert_same_training(cuda[r], cuda_reference, atol=1e-5)
        _assert_same_training(cuda[r], cpu[r], atol=1e-5)


def _nccl_program():
    from globaltensor.runtime import context
    comm = context.current()
    assert (gt.rank(), gt.world_size(), comm.device.type) == (0, 1, "cuda")
    p = gt.placement("cuda", [[0]])
    x = gt.to_global(torch.arange(12.0).reshape(3, 4), p, (S0, S1))
    y = gt.from_local(torch.ones(3, 4), p, (P, B)).to_global(p, (B, S0))
    z = (x @ y.T).to_global(p, (B, B))
    return (x.to_local().device.type, z.to_local().device.type, z.full_tensor().cpu(),
            _train("cuda", (1, 1)))


def test_nccl_with_one_rank_runs_and_matches_the_simulator():
    (xdev, zdev, z, training), = gt.launch(_nccl_program, 1, backend="nccl", timeout=120)
    assert (xdev, zdev) == ("cuda", "cuda")
    assert torch.equal(z, torch.arange(12.0).reshape(3, 4) @ torch.ones(4, 3))
    assert training[2] == {"cuda"}
    _assert_same_training(training, gt.launch(_train, 1, args=("cuda", (1, 1)))[0], atol=1e-6)


def _events(log) -> list:
    return [(e.kind, e.group, e.recv_bytes) for e in log.events]


def _zero3(device: str, steps: int = 3):
    """ZeRO-3 on a 1-D data axis of `device`: on CUDA one reduce-scatter stays in flight across a
    module's backward (`zero.in_flight`), on CPU none does; values and bytes must not change."""
    p = gt.placement(device, [0, 1])
    torch.manual_seed(0)
    model = gt.to_global(GPT(CFG), p, zero_plan(0, 1))
    g = torch.Generator().manual_seed(1)
    idx, tgt = (gt.to_global(torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g), p, dp_batch(0, 1))
                for _ in range(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, logs = [], []
    for _ in range(steps):
        with gt.comm_log() as log:
            loss = model(idx, tgt)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.full_tensor().item())
        logs.append(_events(log))
    devices = {q.to_local().device.type for q in model.parameters()}
    plain = sorted({w for b in model.blocks for w in b.forward.why().values()})  # globaltensor/parallel/plain.py
    return losses, {n: q.full_tensor().detach().cpu() for n, q in model.named_parameters()}, logs, devices, \
        zero.in_flight(torch.device(device)), plain


def test_sim_zero3_on_cuda_keeps_a_reduction_in_flight_and_matches_cpu():
    """Also: the blocks run as plain regions on either device (the fused CUDA attention kernels' hooks are the
    kernel itself without dropout), after a first step through the dispatcher, with the same collectives."""
    cuda, cpu = gt.launch(_zero3, 2, args=("cuda",)), gt.launch(_zero3, 2, args=("cpu",))
    for r in range(2):
        assert cuda[r][5] == cpu[r][5] == [""], (cuda[r][5], cpu[r][5])
        assert cuda[r][3] == {"cuda"} and (cuda[r][4], cpu[r][4]) == (1, 0)
        assert cuda[r][2] == cpu[r][2], f"rank {r}: the collectives differ between cuda and cpu"
        _assert_same_training(cuda[r], cpu[r], atol=1e-5)


def _pipeline(device: str, steps: int = 3):
    """Two stages of one rank each on `device`, 1F1B over 4 micro-batches."""
    stages = [gt.placement(device, [0]), gt.placement(device, [1])]
    torch.manual_seed(0)
    model = gt.to_global(GPT(CFG), stages[0], pp_plan(stages, CFG.n_layer))
    pipe = gt.Pipeline(model, microbatches=4, schedule="1f1b",
                       loss_fn=lambda y, t: torch.nn.functional.cross_entropy(y.reshape(-1, y.size(-1)), t.reshape(-1)))
    g = torch.Generator().manual_seed(1)
    x, t = (torch.randint(0, CFG.vocab_size, (8, CFG.block_size), generator=g) for _ in range(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, logs = [], []
    for _ in range(steps):
        with gt.comm_log() as log:
            loss = pipe.step(x, t)
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        logs.append(_events(log))
    held = {n: q for n, q in model.named_parameters() if gt.rank() in q.placement}
    return losses, {n: q.full_tensor().detach().cpu() for n, q in held.items()}, logs, \
        {q.to_local().device.type for q in held.values()}


def test_sim_pipeline_on_cuda_placements_matches_cpu():
    cuda, cpu = gt.launch(_pipeline, 2, args=("cuda",)), gt.launch(_pipeline, 2, args=("cpu",))
    for r in range(2):
        assert cuda[r][3] == {"cuda"}
        assert cuda[r][2] == cpu[r][2], f"rank {r}: the collectives differ between cuda and cpu"
        np.testing.assert_allclose([x for x in cuda[r][0] if x is not None],
                                   [x for x in cpu[r][0] if x is not None], rtol=0, atol=1e-5)
        for name, q in cuda[r][1].items():
            if not name.endswith("attn.k.bias"):  # as in _assert_same_training
                torch.testing.assert_close(q, cpu[r][1][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("launcher", ["sim", "torchrun-nccl"])
def test_example_trains_on_cuda_and_checks_against_one_device(launcher):
    """examples/train_gpt.py --device cuda --check: its one-device reference runs on the CPU, so the
    comparison must bring the CUDA parameters over (it once raised on mixing devices)."""
    example = ["examples/train_gpt.py", "--device", "cuda", "--steps", "3", "--check"]
    cmd = ([sys.executable, *example] if launcher == "sim" else
           [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", *example,
            "--mesh", "1x1"])  # torchrun's ranks on cuda use nccl
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "matches one device" in out.stdout, out.stdout[-3000:]


def _fused_attention(dtype: torch.dtype, sbp, masked: bool):
    """F.scaled_dot_product_attention on a cuda placement: torch picks its fused kernel from the global
    tensor (flash for bf16, memory-efficient for fp32 or with a mask), which runs on the shards."""
    p = gt.placement("cuda", [0, 1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 64, 32, generator=g).to("cuda", dtype) for _ in range(3))
    mask = torch.randn(64, 64, generator=g).to("cuda", dtype) if masked else None
    with gt.comm_log() as log:
        xs = [gt.to_global(t, p, (sbp,)).requires_grad_() for t in (q, k, v)]
        m = None if mask is None else gt.to_global(mask, p, (B,))
        y = torch.nn.functional.scaled_dot_product_attention(*xs, attn_mask=m, is_causal=not masked)
        y.backward(gt.to_global(torch.ones_like(q), p, y.sbp))
    return (y.full_tensor().cpu(), [x.grad.full_tensor().cpu() for x in xs], log.recv_bytes,
            dict(gt.stats()["fallback"]))


@pytest.mark.parametrize("dtype,masked", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("sbp", [S0, S1, gt.split(2)])
def test_sim_fused_cuda_attention_runs_on_shards_as_one_device(dtype, masked, sbp):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 64, 32, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
    mask = torch.randn(64, 64, generator=g).to("cuda", dtype) if masked else None
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
    y.backward(torch.ones_like(y))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    gt.reset_stats()  # fallbacks are counted per process: only this launch's
    for got in gt.launch(_fused_attention, 2, args=(dtype, sbp, masked)):
        assert not got[3], got[3]
        torch.testing.assert_close(got[0], y.detach().cpu(), rtol=tol, atol=tol)
        for a, b in zip(got[1], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(a, b.cpu(), rtol=tol, atol=tol)
        if sbp != gt.split(2):
            assert got[2] == 0, f"a batch or heads split moved {got[2]} B"
