"""gt.comm_report: every byte of gt.comm_log attributed to a module, op, phase and reason.

The GPT step on a 2x2 (data x tensor) mesh with `tp_plan(1, 2)` must show, per module, the
collectives a Megatron count predicts (tests/test_gpt_comm.py counts them by phase): the
row-parallel outputs' all-reduces forward at `wte`, `*.attn.proj`, `*.mlp.proj`; the
column-parallel inputs' gradient all-reduces backward at `*.attn`, `*.mlp`, `head`; the
loss's [tokens]-sized reductions at the root; the data-parallel gradient bucket outside any
module, at the optimizer's first read.
"""
from __future__ import annotations

import json
import warnings
from collections import Counter

import pytest
import torch

import globaltensor as gt
from globaltensor.models.gpt import GPT, GPTConfig, dp_batch, tp_plan, zero_plan
from globaltensor.runtime.trace import FLAGS

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=16)
BATCH = 8


def _gpt_step(given: bool):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT(CFG)
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    gt.to_global(model, p, tp_plan(1, 2))
    g = torch.Generator().manual_seed(1)
    idx, tgt = (gt.to_global(torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g), p,
                             dp_batch(0, 2)) for _ in range(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gt.comm_log() as log, gt.comm_report(*([model] if given else [])) as rep:
        loss = model(idx, tgt)[1]
        loss.backward()
        opt.step()
    return log, rep, [(tuple(q.shape), q.sbp[1] != gt.broadcast) for q in model.parameters()]


def test_gpt_step_every_byte_attributed_to_megatron_modules():
    for log, rep, params in gt.launch(_gpt_step, 4, args=(True,)):
        assert [(c.kind, c.group, c.recv_bytes) for c in rep.collectives] == \
            [(e.kind, e.group, e.recv_bytes) for e in log.events]
        assert rep.recv_bytes == log.recv_bytes == sum(r["recv_bytes"] for r in rep.rows())
        act = 2 * (BATCH // 2 * CFG.block_size * CFG.n_embd) * 4 // 2   # one [N, h] all-reduce over 2 ranks
        got = Counter()
        for c in rep.collectives:
            got[(c.module, c.phase, c.kind, c.axis)] += c.recv_bytes
        want = Counter({("wte", "forward", "all_reduce", "1"): act, ("head", "backward", "all_reduce", "1"): act})
        for i in range(CFG.n_layer):
            want[(f"blocks.{i}.attn.proj", "forward", "all_reduce", "1")] = act
            want[(f"blocks.{i}.mlp.proj", "forward", "all_reduce", "1")] = act
            want[(f"blocks.{i}.attn", "backward", "all_reduce", "1")] = act
            want[(f"blocks.{i}.mlp", "backward", "all_reduce", "1")] = act
        n_tok = BATCH // 2 * CFG.block_size
        want[("", "forward", "all_reduce", "1")] = 2 * n_tok * 4 // 2 * 2   # log_softmax: row max, row sum
        want[("", "backward", "all_reduce", "1")] = n_tok * 4               # its backward's row sum
        want[("", "forward", "all_reduce", "0")] = 4                        # target count over the batch split
        bucket = sum(2 * (n // 2 if split else n) * 4 // 2 for n, split in
                     ((int(torch.tensor(s).prod()), split) for s, split in params))
        want[("(outside modules)", "outside", "all_reduce", "0")] = bucket
        assert got == want
        reasons = {(c.module, c.phase): c.reason for c in rep.collectives}
        assert reasons[("wte", "forward")].startswith("ModuleLayout(output) of wte")
        assert reasons[("blocks.0.attn", "backward")].startswith("ModuleLayout(input_grad) of blocks.0.attn")
        assert reasons[("(outside modules)", "outside")].startswith("gradient bucket: ")
        assert any(c.reason.startswith("aten._log_softmax, ") for c in rep.collectives if c.module == "")
        assert f"    blocks.1.mlp.proj: 1 x, {act} B" in str(rep)
        data = json.loads(rep.to_json())
        assert data["recv_bytes"] == log.recv_bytes and len(data["events"]) == len(log.events)
        trace = rep.chrome_trace()
        spans = [e for e in trace["traceEvents"] if e["cat"] != "compute"]
        assert len(spans) == len(log.events) and all(e["dur"] >= 0 for e in trace["traceEvents"])
    assert not FLAGS.on


def test_modules_discovered_without_being_given():
    (log, rep, _), *_ = gt.launch(_gpt_step, 4, args=(False,))
    mods = {c.module for c in rep.collectives}
    assert {"wte", "blocks.0.attn.proj", "blocks.1.mlp", "head", ""} <= mods
    assert rep.recv_bytes == log.recv_bytes


def _op_reason():
    p = gt.placement("cpu", [0, 1])
    a = gt.to_global(torch.ones(4, 6), p, gt.split(1))
    b = gt.to_global(torch.ones(6, 2), p, gt.split(1))
    with gt.comm_report() as rep:
        (a @ b).full_tensor()
        a.to_global(p, gt.broadcast)
    return rep


def test_op_argument_and_to_global_reasons():
    rep = gt.launch(_op_reason, 2)[0]
    reasons = [c.reason for c in rep.collectives]
    assert any(r.startswith("aten.mm, argument 1 [6, 2]: S(1) -> ") for r in reasons), reasons
    assert reasons[-1] == "to_global [4, 6]: S(1) -> B"
    assert rep.collectives[-1].lower_bound == rep.collectives[-1].recv_bytes == 48


def _zero_step():
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT(CFG)
    p = gt.placement("cpu", [0, 1])
    gt.to_global(model, p, zero_plan(0, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = gt.to_global(torch.randint(0, CFG.vocab_size, (4, CFG.block_size)), p, gt.split(0))
    with gt.comm_log() as log, gt.comm_report(model) as rep:
        model(idx, idx)[1].backward()
        opt.step()
    return log, rep


def test_zero_gathers_and_reduce_scatters_named():
    log, rep = gt.launch(_zero_step, 2)[0]
    assert rep.recv_bytes == log.recv_bytes
    kinds = Counter((c.kind, c.phase, c.reason.split(":")[0]) for c in rep.collectives)
    assert kinds[("all_gather", "forward", "ZeRO")] == CFG.n_layer + 1
    assert kinds[("all_gather", "backward", "ZeRO-3")] == CFG.n_layer + 1
    assert kinds[("reduce_scatter", "backward", "ZeRO")] == CFG.n_layer + 1
    assert {c.module for c in rep.collectives if c.kind == "reduce_scatter"} == \
        {""} | {f"blocks.{i}" for i in range(CFG.n_layer)}


class _Gather(torch.nn.Module):
    def forward(self, x):
        return x.to_global(x.placement, gt.broadcast)


def _shared_and_nested(model):
    p = gt.placement("cpu", [0, 1])
    x = gt.to_global(torch.ones(4, 6), p, gt.split(1))
    with gt.comm_report(model) as outer:
        with gt.comm_report(model) as inner:
            model(x)
        model(x)
    return [c.module for c in inner.collectives], [c.module for c in outer.collectives]


def test_ranks_sharing_a_model_and_nested_reports():
    """The simulator's ranks may share one module object (and its hooks); reports may nest."""
    model = torch.nn.Sequential(_Gather())
    for inner, outer in gt.launch(_shared_and_nested, 2, args=(model,)):
        assert inner == ["0"] and outer == inner * 2


def _nested_logs():
    p = gt.placement("cpu", [0, 1])
    x = gt.to_global(torch.ones(4), p, gt.split(0))
    with gt.comm_log() as outer:
        with gt.comm_log() as inner:
            x.to_global(p, gt.broadcast)
        x.to_global(p, gt.broadcast)
    return len(outer.events), len(inner.events)


def test_nested_comm_logs_leave_by_identity():
    """Two logs holding the same events compare equal; the inner one's exit must not end the outer one."""
    assert gt.launch(_nested_logs, 2) == [(2, 1), (2, 1)]


def _gpt_report_rows():
    log, rep, _ = _gpt_step(True)
    trace = rep.chrome_trace(all_ranks=True)
    rows = [(c.module, c.phase, c.op, c.kind, c.axis, c.recv_bytes, c.reason) for c in rep.collectives]
    return rows, log.recv_bytes, trace["traceEvents"]


@pytest.mark.gloo
@pytest.mark.slow  # ~30 s on 4 gloo processes
def test_gloo_report_matches_the_simulator_and_traces_every_rank():
    real = gt.launch(_gpt_report_rows, 4, backend="gloo", timeout=120)
    sim = gt.launch(_gpt_report_rows, 4)
    for (rows, total, _), (sim_rows, sim_total, _) in zip(real, sim):
        assert rows == sim_rows and total == sim_total == sum(r[5] for r in rows)
    events = real[0][2]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    for pid in range(4):
        spans = [e for e in events if e["pid"] == pid]
        ends = [e["ts"] + e["dur"] for e in spans]
        assert ends == sorted(ends) and all(e["dur"] >= 0 for e in spans)
