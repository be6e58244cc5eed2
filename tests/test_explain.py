"""gt.explain: a dry run on meta tensors reports the bytes a real run moves, without the memory."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan, zero_plan


def _step(cfg, mesh, plan, batch, optimizer=torch.optim.AdamW):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT(cfg)
    p = gt.placement("cpu", np.arange(mesh[0] * mesh[1]).reshape(mesh).tolist())
    gt.to_global(model, p, plan)
    idx = gt.to_global(torch.randint(0, cfg.vocab_size, (batch, cfg.block_size)), p, dp_batch(0, 2))
    opt = optimizer(model.parameters(), lr=1e-2)
    model(idx, idx)[1].backward()
    opt.step()
    return opt


def _real(*args):
    with gt.comm_report() as rep:
        _step(*args)
    return rep


def _rows(rep):
    return [(c.module, c.phase, c.op, c.kind, c.axis, c.recv_bytes, c.reason) for c in rep.collectives]


SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=16)


@pytest.mark.parametrize("plan", ["tp", "zero+tp"])
def test_dry_run_equals_real_run(plan):
    spec = tp_plan(1, 2) if plan == "tp" else zero_plan(0, 2, tensor_axis=1)
    args = (SMALL, (2, 2), spec, 8)
    real = gt.launch(_real, 4, args=args)
    dry = gt.explain(_step, 4, args=args)
    assert [_rows(r) for r in dry] == [_rows(r) for r in real]
    assert dry[0].recv_bytes > 0


def _state_stays_meta(optimizer):
    opt = _step(SMALL, (2, 2), tp_plan(1, 2), 8, optimizer)
    for state in opt.state.values():
        assert state["step"].item() == 1
        for name, v in state.items():  # the moments meta, the scalars (step, NAdam's mu_product) on the host
            if isinstance(v, gt.GlobalTensor):
                assert v.to_local().is_meta, name
            else:
                assert v.dim() == 0 and not v.is_meta, name


@pytest.mark.parametrize("optimizer", [torch.optim.RAdam, torch.optim.NAdam, torch.optim.Adamax],
                         ids=lambda o: o.__name__)
def test_dry_run_of_an_optimizer_whose_step_counter_takes_the_default_device(optimizer):
    """These optimizers (and torch 2.11's Adam and AdamW) make their step counter on the default device and
    read it with `.item()`: inside `step()` a dry run makes such tensors on the host, as a real run does;
    the moments stay meta, and the bytes are the real run's."""
    args = (SMALL, (2, 2), tp_plan(1, 2), 8, optimizer)
    real = gt.launch(_real, 4, args=args)
    dry = gt.explain(_step, 4, args=args)
    assert [_rows(r) for r in dry] == [_rows(r) for r in real]
    gt.explain(_state_stays_meta, 4, args=(optimizer,))


def _shapes_only():
    model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=2, n_head=8, n_embd=512))
    gt.to_global(model, gt.placement("cpu", [[0, 1], [2, 3]]), tp_plan(1, 2))
    assert model.wte.weight.to_local().is_meta and model.wte.weight.device.type == "cpu"


def test_big_configuration_allocates_nothing():
    """A 1024-token, 50k-vocab GPT on 2x2: shards are meta, the wrappers look like cpu (as a real run's)."""
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=2, n_head=8, n_embd=512)
    gt.explain(_shapes_only, 4)
    rep = gt.explain(_step, 4, args=(cfg, (2, 2), tp_plan(1, 2), 4))[0]
    act = 2 * 1024 * 512 * 4  # one [N, h] fp32 all-reduce over the 2 tensor ranks: N = 2 x 1024 tokens
    fwd = [c for c in rep.collectives if c.phase == "forward" and c.kind == "all_reduce" and c.axis == "1"
           and c.module.endswith("proj")]
    assert len(fwd) == 2 * cfg.n_layer and all(c.recv_bytes == act for c in fwd)


def test_reading_values_is_an_error():
    def program():
        x = gt.to_global(torch.ones(4), gt.placement("cpu", [0, 1]), gt.split(0))
        return x.sum().item()
    with pytest.raises(Exception):
        gt.explain(program, 2)
