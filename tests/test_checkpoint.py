"""Checkpoints through torch.distributed.checkpoint (issue 14): each element saved once, any layout
loaded into any other, optimizer state along, bitwise resume after SIGKILL, clear errors, safe loading."""
from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, strategies as st
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

import globaltensor as gt
from globaltensor import checkpoint as gtc
from globaltensor.models.gpt import GPT, GPTConfig, tp_plan

from checkpoint_worker import train
from strategies import nd_sbps, placements, tensor_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:load_training",
                                        "ignore:Detected an existing checkpoint")
WORKER = os.path.join(ROOT, "tests", "checkpoint_worker.py")
DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16)


def _value(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Distinct values, so a chunk read into the wrong place shows."""
    return (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 1.5 - 7).to(dtype)


def _chunks(md, key: str) -> list:
    return [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks]


def _expected_local(full: torch.Tensor, layout: gt.Layout, rank: int) -> torch.Tensor | None:
    box = layout.shard(full.shape, rank)
    if box is None:
        return None
    for d, (start, size) in enumerate(box):
        full = full.narrow(d, start, size)
    return full


@st.composite
def layout_pairs(draw):
    shape = draw(tensor_shapes(max_ndim=3, max_size=7))
    (p1, w1), (p2, w2) = draw(placements(max_ranks=8, extra_ranks=1)), draw(placements(max_ranks=8, extra_ranks=1))
    s1, s2 = draw(nd_sbps(p1.ndim, len(shape))), draw(nd_sbps(p2.ndim, len(shape)))
    return shape, draw(st.sampled_from(DTYPES)), (p1, s1), (p2, s2), max(w1, w2)


@given(layout_pairs())
def test_any_layout_loads_into_any_other_bitwise(tmp_path_factory, case):
    """Saved under one layout, loaded into another (other mesh, other ranks, other world): the
    loaded shards are the saved values bitwise, and the chunks in the files add up to the tensor."""
    shape, dtype, (p1, s1), (p2, s2), world = case
    path = str(tmp_path_factory.mktemp("ckpt"))
    full = _value(shape, dtype)

    def body():
        x = gt.to_global(full, p1, s1)
        md = gtc.save({"t": x}, path)
        y = gt.to_global(torch.zeros(shape, dtype=dtype), p2, s2)
        gtc.load({"t": y}, path)
        want = _expected_local(full, y.global_layout, gt.rank())
        return md, want is None or torch.equal(y.to_local(), want)

    out = gt.launch(body, world)
    md = out[0][0]
    assert all(ok for _, ok in out)
    sizes = [math.prod(size) for _, size in _chunks(md, "t")]
    assert sum(sizes) == full.numel()  # every element once: no replica written twice, none missing
    assert len(sizes) == (1 if full.numel() == 0 else sum(1 for s in sizes if s))  # no empty chunk but one


def test_replicas_written_once_spread_over_ranks(tmp_path):
    """A Broadcast tensor is written by one rank; many Broadcast tensors are spread over the ranks."""
    p = gt.placement("cpu", [[0, 1], [2, 3]])

    def body():
        sd = {f"w{i}": gt.to_global(torch.full((3,), float(i)), p, (gt.broadcast, gt.broadcast)) for i in range(16)}
        sd["s"] = gt.to_global(torch.arange(8.0), p, (gt.broadcast, gt.split(0)))
        return gtc.save(sd, str(tmp_path))

    gt.launch(body, 4)
    # the written .metadata, not the Metadata save returns: only FileSystemWriter.finish fills in
    # storage_data, in place on torch 2.13 but on a copy (dataclasses.replace) on torch 2.11
    md = gtc.read_metadata(tmp_path)
    assert all(len(_chunks(md, f"w{i}")) == 1 for i in range(16))
    assert sorted(_chunks(md, "s")) == [((0,), (4,)), ((4,), (4,))]
    writers = {info.relative_path.split("_")[2] for info in md.storage_data.values()}
    assert len(writers) == 4  # every rank wrote part of the replicated weights


def test_load_reads_only_overlapping_chunks(tmp_path):
    """Resharding is DCP's: a rank's load plan names only the saved chunks overlapping its shard."""
    full = torch.arange(16.0)

    class Recording(DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.read = sorted(tuple(i.storage_index.offset) for i in plan.items)
            return plan

    def body():
        gtc.save({"t": gt.to_global(full, gt.placement("cpu", [0, 1, 2, 3]), gt.split(0))}, str(tmp_path))
        y = gt.zeros(16, placement=gt.placement("cpu", [0, 1]), sbp=gt.split(0))
        planner = Recording()
        dcp.load({"t": y}, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
        return getattr(planner, "read", []), torch.equal(y.to_local(), full[8 * gt.rank(): 8 * gt.rank() + 8])

    out = gt.launch(body, 4)
    assert out[0] == ([(0,), (4,)], True) and out[1] == ([(8,), (12,)], True)
    assert out[2][0] == [] and out[3][0] == []  # outside the placement: nothing read


def test_zero_dim_and_empty_tensors(tmp_path):
    p = gt.placement("cpu", [0, 1, 2])

    def body():
        sd = {"scalar": gt.to_global(torch.tensor(2.5), p, gt.broadcast),
              "empty": gt.to_global(torch.zeros(0, 4), p, gt.split(1)), "plain": torch.tensor([1, 2])}
        gtc.save(sd, str(tmp_path))
        back = {"scalar": gt.zeros((), placement=gt.placement("cpu", [1, 2]), sbp=gt.broadcast),
                "empty": gt.zeros(0, 4, placement=p, sbp=gt.split(0)), "plain": torch.zeros(2, dtype=torch.int64)}
        gtc.load(back, str(tmp_path))
        return back["scalar"].full_tensor().item() if gt.rank() else 2.5, back["plain"].tolist()

    assert gt.launch(body, 3) == [(2.5, [1, 2])] * 3


def _gpt_model(plan: dict | None, ranks) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    if plan is not None:
        gt.to_global(model, gt.placement("cpu", ranks), plan)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    full = lambda v: v.full_tensor() if isinstance(v, gt.GlobalTensor) else v  # noqa: E731
    return {"model": {k: full(v) for k, v in msd.items()},
            "optim": {k: {kk: full(vv) for kk, vv in v.items()} for k, v in osd["state"].items()}}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_equal(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_gpt_reshards_dp_tp_to_zero_to_tp_to_plain_and_back(tmp_path):
    """Model and AdamW state saved on 2x2 DP x TP load into ZeRO-3 (S(0) on 4), TP on 2 and the plain
    single-device GPT (equal state dicts), and a plain checkpoint loads back into 2x2."""
    dp_tp = tp_plan(tensor_axis=1, ndim=2)
    zero = {"*": gt.split(0), "blocks.*": gt.ModuleLayout(params=(gt.broadcast,))}  # ZeRO-3: stored S(0), state too
    tp2 = tp_plan(tensor_axis=0, ndim=1)
    a, b, c, d = (str(tmp_path / n) for n in "abcd")

    def trained():
        model, opt = _gpt_model(dp_tp, [[0, 1], [2, 3]])
        data = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
        model(data[:, :-1], data[:, 1:])[1].backward()
        opt.step()
        gtc.save_training(a, model, opt, 1)
        return _full_state(model, opt)

    ref = gt.launch(trained, 4)[0]

    def hop(plan, ranks, src, dst):
        def body():
            model, opt = _gpt_model(plan, ranks)
            assert gtc.load_training(src, model, opt) == 1
            gtc.save_training(dst, model, opt, 1)
            return _full_state(model, opt)
        return body

    _assert_equal(gt.launch(hop(zero, [0, 1, 2, 3], a, b), 4)[0], ref)
    _assert_equal(gt.launch(hop(tp2, [0, 1], b, c), 2)[0], ref)
    model, opt = _gpt_model(None, None)  # one plain process: DCP without any process group
    state = gtc.load({"model": get_state_dict(model, opt)[0]}, c, strict=True)
    model.load_state_dict(state["model"])
    assert model.state_dict().keys() == ref["model"].keys()
    _assert_equal({k: v for k, v in model.state_dict().items()}, ref["model"])
    gtc.save({"model": model.state_dict()}, d)

    def back():
        model, _ = _gpt_model(dp_tp, [[0, 1], [2, 3]])
        sd = model.state_dict()
        gtc.load({"model": sd}, d)
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    _assert_equal(gt.launch(back, 4)[0], ref["model"])


def _plain_dcp_under_gloo(path: str, path_async: str) -> tuple:
    full = _value((5, 7), torch.float32)
    p = gt.placement("cpu", [0, 1])
    x, y = gt.to_global(full, p, gt.split(0)), gt.to_global(full, p, (gt.broadcast,))
    md = dcp.save({"x": x, "y": y}, checkpoint_id=path)  # DCP unchanged: its own planner, writer, group
    fut = gtc.save({"x": x}, path_async, async_save=True)
    x.mul_(0)  # training goes on while the upload runs: the staged copy is what is saved
    fut.result()
    a, b = gt.zeros(5, 7, placement=p, sbp=gt.split(1)), gt.zeros(5, 7, placement=p, sbp=gt.split(0))
    dcp.load({"x": a, "y": b}, checkpoint_id=path)
    c = gt.zeros(5, 7, placement=gt.placement("cpu", [1]), sbp=gt.broadcast)
    dcp.load({"x": c}, checkpoint_id=path_async)
    return (_chunks(md, "x"), _chunks(md, "y"), a.full_tensor().equal(full), b.full_tensor().equal(full),
            gt.rank() == 0 or c.to_local().equal(full))


@pytest.mark.gloo
def test_plain_dcp_and_async_save_under_gloo(tmp_path):
    out = gt.launch(_plain_dcp_under_gloo, 2, backend="gloo", args=(str(tmp_path / "a"), str(tmp_path / "b")),
                    timeout=120)
    assert out[0] == out[1] == ([((0, 0), (3, 7)), ((3, 0), (2, 7))], [((0, 0), (5, 7))], True, True, True)


def test_save_and_load_move_no_tensor_and_fall_back_on_nothing(tmp_path):
    """DCP reads each rank's shard where it lies: no gather (the issue's is_pinned fallback did one),
    only small metadata objects cross ranks, on the simulator."""
    def body():
        model, opt = _gpt_model(tp_plan(tensor_axis=1, ndim=2), [[0, 1], [2, 3]])
        gt.reset_stats()
        with gt.comm_log() as log:
            gtc.save_training(str(tmp_path), model, opt, 0)
            gtc.load_training(str(tmp_path), model, opt)
        return gt.stats()["fallback"], log.recv_bytes, set(log.summary())

    assert gt.launch(body, 4) == [({}, 0, {"all_gather_object"})] * 4


# -- bad input ----------------------------------------------------------------------------------

def test_partial_is_refused_naming_the_key(tmp_path):
    def body():
        x = gt.from_local(torch.ones(3), gt.placement("cpu", [0, 1]), gt.partial_sum)
        gtc.save({"grad_sum": x}, str(tmp_path))

    with pytest.raises(ValueError, match=r"'grad_sum'.*Partial.*Reduce it first"):
        gt.launch(body, 2)


def test_plain_dcp_save_on_the_simulator_is_refused(tmp_path):
    def body():
        dcp.save({"x": gt.zeros(4, placement=gt.placement("cpu", [0, 1]), sbp=gt.split(0))},
                 checkpoint_id=str(tmp_path), no_dist=True)

    with pytest.raises(BaseException, match="globaltensor.checkpoint.SavePlanner"):  # DCP's CheckpointException
        gt.launch(body, 2)
    assert not os.path.exists(tmp_path / gtc.METADATA)


def test_bad_loads_name_the_key_or_path(tmp_path):
    path = str(tmp_path / "ck")
    gtc.save({"w": torch.ones(2, 3), "b": torch.zeros(3)}, path)
    w = torch.full((3, 3), 7.0)
    with pytest.raises(ValueError, match=r"'w' has shape \(3, 3\) here but \(2, 3\) in the checkpoint"):
        gtc.load({"w": w, "b": torch.ones(3)}, path)
    with pytest.raises(KeyError, match=r"'missing' is not in the checkpoint"):
        gtc.load({"b": torch.ones(3), "missing": torch.ones(1)}, path)
    b = torch.ones(3)
    assert gtc.load({"b": b, "missing": torch.ones(1)}, path, strict=False)["b"].equal(torch.zeros(3))
    for bad in (str(tmp_path), str(tmp_path / "nowhere")):
        with pytest.raises(FileNotFoundError, match="is not a torch.distributed.checkpoint directory"):
            gtc.load({"b": b}, bad)
    assert w.eq(7).all()  # nothing half-loaded


def test_load_training_refuses_a_partial_match(tmp_path):
    """DCP loads a subset of a checkpoint silently; a training state missing a layer is an error."""
    big = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    gtc.save_training(str(tmp_path), big, torch.optim.AdamW(big.parameters()), 3)
    small = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"holds 8 keys that this model and optimizer lack, e.g. \['model.1.bias'"):
        gtc.load_training(str(tmp_path), small, torch.optim.AdamW(small.parameters()))
    same = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert gtc.load_training(str(tmp_path), same, torch.optim.AdamW(same.parameters())) == 3
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), big.state_dict().values()))


class _Unsaveable:
    def __reduce__(self):
        raise RuntimeError("disk full")


def test_an_interrupted_overwrite_is_no_checkpoint(tmp_path):
    """Saving over a checkpoint drops its metadata before writing: a save that fails half way leaves
    no old metadata over new files; `latest` skips it and `load` names it."""
    root = tmp_path / "run"
    gtc.save({"w": torch.ones(3)}, str(root / "step-1"))
    gtc.save({"w": torch.ones(3)}, str(root / "step-2"))
    with pytest.raises(RuntimeError, match="disk full"):
        gtc.save({"w": torch.full((3,), 2.0), "extra": _Unsaveable()}, str(root / "step-2"))
    assert gtc.latest(str(root)) == str(root / "step-1")
    with pytest.raises(FileNotFoundError, match="step-2"):
        gtc.load({"w": torch.zeros(3)}, str(root / "step-2"))


def test_metadata_unpickler_refuses_other_globals(tmp_path):
    """A `.metadata` naming anything but DCP's metadata classes is refused, not run."""
    path = str(tmp_path)
    gtc.save({"b": torch.zeros(3)}, path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(os.path.join(path, gtc.METADATA), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        gtc.load({"b": torch.ones(3)}, path)


# -- bitwise resume after SIGKILL -------------------------------------------------------------

def _run_until_killed(root: str, steps: int, kill_after: int, backend: str) -> list[str]:
    """Start the worker in its own process group, SIGKILL every process of it once the checkpoint
    of step `kill_after` is complete (the run goes on meanwhile: the kill lands mid-step or mid-save)."""
    proc = subprocess.Popen([sys.executable, WORKER, root, str(steps), "--backend", backend],
                            stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == f"saved {kill_after}":
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, lines
    return lines


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(ln.split()[1]): ln.split()[3] for ln in lines if ln.startswith("step ")}


@pytest.mark.parametrize("backend", ["sim", pytest.param("gloo", marks=[pytest.mark.gloo, pytest.mark.slow])])
def test_resume_after_sigkill_is_bitwise(tmp_path, backend):
    """Train 4 steps saving each; SIGKILL the run (every rank) after the checkpoint of step 2 while it
    goes on; restart from the last complete checkpoint: the losses and the parameters equal the
    uninterrupted run's bitwise (GPT with dropout: the RNG continues exactly; AdamW; TP on 2 ranks)."""
    steps, kill_after = 4, 2
    ref, digest = gt.launch(train, 2, backend=backend, args=(str(tmp_path / "ref"), steps, False, "float32"))[0]
    root = str(tmp_path / "run")
    before = _losses(_run_until_killed(root, steps, kill_after, backend))
    after = subprocess.run([sys.executable, WORKER, root, str(steps), "--backend", backend, "--resume"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert after.returncode == 0, after.stderr[-3000:]
    resumed = _losses(after.stdout.splitlines())
    assert min(resumed) >= kill_after and max(resumed) == steps - 1, resumed
    assert before == {k: ref[k] for k in before} and resumed == {k: ref[k] for k in resumed}
    assert f"params {digest}" in after.stdout.splitlines()


def test_resume_in_float64_is_bitwise(tmp_path):
    """The same in fp64, on the simulator within this process: 2 steps, a fresh model resumed for 2 more."""
    ref, digest = gt.launch(train, 2, args=(str(tmp_path / "ref"), 4, False, "float64"))[0]
    first, _ = gt.launch(train, 2, args=(str(tmp_path / "run"), 2, False, "float64"))[0]
    second, resumed_digest = gt.launch(train, 2, args=(str(tmp_path / "run"), 4, True, "float64"))[0]
    assert {**first, **second} == ref and sorted(second) == [2, 3] and resumed_digest == digest
