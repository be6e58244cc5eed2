"""Issue 36: a newcomer's bugs, each pinned by a test that failed before its fix.

1. cross-entropy of Partial (row-parallel) or batch-split logits with a plain target;
2. a 0-d GlobalTensor formatted into an f-string (`f"expert_{idx}"`);
3. a gloo child that exits without a result;
4. the unguarded-script error printed once.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import globaltensor as gt

D = torch.float64
MESHES = {2: [0, 1], 4: [0, 1, 2, 3], "2x2": [[0, 1], [2, 3]]}


def _world(mesh) -> int:
    return 4 if len(str(mesh)) > 6 else 2


def _each_axis(mesh, sbp):
    return (sbp, sbp) if isinstance(mesh[0], list) else sbp


# -- 1. cross-entropy of Partial logits, plain target ------------------------------------------------
LOSS_KWARGS = st.sampled_from([{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1},
                               {"ignore_index": 2}, {"weight": "w"}])


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@settings(max_examples=6, deadline=None)
@given(kwargs=LOSS_KWARGS, n=st.integers(1, 9), ignored=st.booleans())
def test_cross_entropy_of_row_parallel_logits_with_a_plain_target(mesh, kwargs, n, ignored):
    """x split on its hidden dim @ w split on its rows leaves Partial logits; the target is a plain
    LongTensor (taken as Broadcast). The loss and both gradients equal one device's."""
    mesh = MESHES[mesh]
    torch.manual_seed(n)
    x, w = torch.randn(n, 8, dtype=D), torch.randn(8, 5, dtype=D)
    target = torch.randint(0, 5, (n,))
    kwargs = dict(kwargs)
    if kwargs.get("weight") == "w":
        kwargs["weight"] = torch.rand(5, dtype=D) + 0.1
    if ignored:
        kwargs.setdefault("ignore_index", -100)
        target[0] = kwargs["ignore_index"]
        if n == 1 and kwargs.get("reduction", "mean") == "mean":
            target[0] = 1  # a mean over no scored target is NaN on one device too: not this test's subject
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.cross_entropy(xl @ wl, target, **kwargs)
    seed = torch.randn(want.shape, dtype=D)
    (want * seed).sum().backward()

    def body():
        p = gt.placement("cpu", mesh)
        gx = gt.to_global(x, p, _each_axis(mesh, gt.split(1))).requires_grad_()
        gw = gt.to_global(w, p, _each_axis(mesh, gt.split(0))).requires_grad_()
        logits = gx @ gw
        assert any(isinstance(s, gt.Partial) for s in logits.sbp), logits.sbp
        out = F.cross_entropy(logits, target, **kwargs)
        (out * seed).sum().backward()
        return out.full_tensor(), gx.grad.full_tensor(), gw.grad.full_tensor()

    for loss, gx, gw in gt.launch(body, _world(mesh)):
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(gx, xl.grad)
        torch.testing.assert_close(gw, wl.grad)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("how", ["from_local partial_sum", "batch split"])
def test_cross_entropy_mean_with_a_plain_target(mesh, how):
    """The batch-split mean divides the summed loss by the count of scored targets; of a plain target
    that count is plain (whole on every rank already), which the decomposition used to reduce as if
    it were a Partial GlobalTensor."""
    mesh = MESHES[mesh]
    world = _world(mesh)
    torch.manual_seed(1)
    logits = torch.randn(world * 3, 7, dtype=D)
    target = torch.randint(0, 7, (world * 3,))
    target[1] = -100
    want_x = logits.clone().requires_grad_()
    want = F.cross_entropy(want_x, target)
    want.backward()

    def body():
        p = gt.placement("cpu", mesh)
        if how == "batch split":
            g = gt.to_global(logits, p, _each_axis(mesh, gt.split(0))).requires_grad_()
            leaf = g
        else:  # each rank holds a share of the logits whose sum is the whole
            share = logits / world + (gt.rank() - (world - 1) / 2) * 0.25
            leaf = share.clone().requires_grad_()
            g = gt.from_local(leaf, p, _each_axis(mesh, gt.partial_sum))
        loss = F.cross_entropy(g, target)
        loss.backward()
        grad = leaf.grad.full_tensor() if how == "batch split" else leaf.grad
        return loss.full_tensor(), grad

    for loss, grad in gt.launch(body, world):
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(grad, want_x.grad)  # a Partial input's gradient: each share's is the whole's


# -- 2. a 0-d GlobalTensor in an f-string ----------------------------------------------------------
SPECS = {int: ["", "d", "03d", ">5", "x", ",", "+d"], float: ["", ".3f", "8.2e", ">10.4g", "%", ".0f"],
         bool: ["", ">6"]}
# + 0.0: no -0.0, which a Partial's sum of shares (-0.0 + 0.0) gives as 0.0
FLOATS = st.floats(-1e6, 1e6, allow_nan=False).map(lambda v: round(v, 3) + 0.0)
VALUES = st.one_of(st.integers(-10 ** 6, 10 ** 6), FLOATS, st.booleans())


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=8, deadline=None)
@given(value=VALUES, data=st.data())
def test_a_0d_global_tensor_formats_as_its_value(world, value, data):
    """f"{x:spec}" of a 0-d Broadcast or Partial GlobalTensor is plain torch's, on every rank."""
    spec = data.draw(st.sampled_from(SPECS[type(value)]))
    plain = torch.tensor(value)
    want = [f"expert_{plain}", format(plain, spec), f"{plain:{spec}}"]

    def body():
        p = gt.placement("cpu", list(range(world)))
        shown = {}
        b = gt.to_global(plain, p, gt.broadcast)
        shown["broadcast"] = [f"expert_{b}", format(b, spec), f"{b:{spec}}"]
        if plain.dtype is not torch.bool:  # a share on rank 0, zeros elsewhere: the sum is exact
            share = plain if gt.rank() == 0 else torch.zeros_like(plain)
            q = gt.from_local(share, p, gt.partial_sum)
            shown["partial"] = [f"expert_{q}", format(q, spec), f"{q:{spec}}"]
        return shown

    for rank, shown in enumerate(gt.launch(body, world)):
        for kind, got in shown.items():
            assert got == want, f"rank {rank}, {kind}: {got} != {want}"


def test_an_indexed_expert_id_keys_a_dict_and_n_d_tensors_format_as_torch():
    """Switch Transformers' `f"expert_{idx}"` with idx taken from a split tensor; an n-d tensor keeps
    object.__format__: its repr for an empty spec, a TypeError for any other, as torch's."""
    def body():
        p = gt.placement("cpu", [0, 1])
        ids = gt.to_global(torch.arange(4), p, gt.split(0))
        keys = [f"expert_{ids[i]}" for i in range(4)]
        grad = gt.to_global(torch.tensor(1.5), p, gt.broadcast).requires_grad_()
        keys.append(f"{grad * 2:.1f}")  # requires grad: formats without a warning, as torch's
        with pytest.raises(TypeError, match="unsupported format string"):
            format(ids, ".2f")
        return keys, f"{ids}" == repr(ids)

    for keys, same in gt.launch(body, 2):
        assert keys == ["expert_0", "expert_1", "expert_2", "expert_3", "3.0"]
        assert same


# -- 3, 4. gloo ranks that end without a result; the unguarded script's message once ----------------
PROGRAM = textwrap.dedent("""
    import os, sys, time
    import torch, globaltensor as gt

    def program():
        {body}
        x = gt.to_global(torch.arange(4.0), gt.placement("cpu", list(range({world}))), gt.split(0))
        return x.full_tensor().sum().item()

    {top}
""")
MAIN = """if __name__ == "__main__":
    t0 = time.monotonic()
    try:
        print(gt.launch(program, {world}, backend="gloo", timeout=60))
    except Exception as e:
        print(type(e).__name__, getattr(e, "rank", None), round(time.monotonic() - t0), e, sep="|")"""


def _script(tmp_path, body="pass", top=MAIN, world=2):
    """Run a tiny gloo program as a script of its own (spawned ranks import it): (returncode, stdout,
    stderr, path). A launch that waits forever fails here on subprocess's timeout instead of hanging."""
    path = tmp_path / "newcomer.py"
    path.write_text(PROGRAM.format(body=body, world=world, top=top.format(world=world)))
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=150)
    return r.returncode, r.stdout.strip(), r.stderr, str(path)


def _failure(stdout):
    kind, rank, took, message = stdout.splitlines()[-1].split("|", 3)
    return kind, int(rank), int(took), message


@pytest.mark.gloo
def test_a_rank_that_exits_0_while_running_fn_is_named(tmp_path):
    """os._exit(0) on rank 1: no result, no error sent; the launch ends (well within its 60 s timeout)
    naming rank 1, not waiting for it forever."""
    code, out, err, _ = _script(tmp_path, body="if gt.rank() == 1:\n            os._exit(0)")
    assert code == 0, err
    kind, rank, took, message = _failure(out)
    assert (kind, rank) == ("RankError", 1), out
    assert "rank 1 exited with exit code 0 without a result while running program" in message, message
    assert took < 30, out


@pytest.mark.gloo
def test_a_script_that_exits_at_import_in_the_ranks_is_named(tmp_path):
    """The spawned ranks import the script, which raises SystemExit there (exit code 0): reported, with
    the rank, as an exit before running fn, not waited for."""
    code, out, err, path = _script(tmp_path, top="if __name__ == '__mp_main__':\n    raise SystemExit(0)\n" + MAIN)
    assert code == 0, err
    kind, rank, took, message = _failure(out)
    assert (kind, rank) == ("RankError", 0), out
    assert "rank 0 exited with exit code 0 without a result before running program" in message, message
    assert path in message and "SystemExit" in message
    assert took < 30, out


@pytest.mark.gloo
def test_the_unguarded_script_error_prints_once(tmp_path):
    """Each of 4 spawned ranks meets the unguarded gt.launch while importing the script: they exit
    quietly and the caller's one error says why (it printed world_size + 1 times)."""
    top = 'print(gt.launch(program, world_size={world}, backend="gloo"))'
    code, out, err, path = _script(tmp_path, top=top, world=4)
    assert code != 0
    assert err.count('if __name__ == "__main__":') == 1, err
    assert err.count("Traceback") == 1, err
    last = err.strip().splitlines()
    tail = "\n".join(last[-3:])
    assert "before running program" in tail and path in tail and "calls gt.launch at import" in tail, tail


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_under_data_parallelism_moves_ddps_bytes(batch_first):
    """`nn.TransformerEncoder` as a newcomer converts it (every parameter Broadcast, the batch split over 4 ranks),
    one AdamW step: DDP's all-reduce of the gradients and nothing else, in one collective, equal to one device.
    `nn.MultiheadAttention` flattens its (sequence, batch) dims around its projections, the batch inside: a
    contiguous split of the flattened rows was an all-to-all each way (1.85x DDP's bytes at filing time; 31
    all-to-alls and 2 all-gathers a step after), where each rank's rows are its piece of every sequence
    position's block: a strided split, no bytes (`ops/strided_split.merged_view`)."""
    import copy
    from torch import nn
    from globaltensor.runtime.comm import all_reduce_recv_bytes
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first)
    ref = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()
    x = torch.randn(8, 6, 16, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    n = 4

    def step(m: nn.Module, xx: torch.Tensor) -> None:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(xx).square().sum().backward()
        opt.step()

    def body():
        m, p = copy.deepcopy(ref), gt.placement("cpu", list(range(n)))
        gt.to_global(m, p, {"*": gt.broadcast})
        with gt.comm_log() as log:
            step(m, gt.to_global(x, p, gt.split(0 if batch_first else 1)))
        return {k: v.full_tensor() for k, v in m.state_dict().items()}, [(e.kind, e.recv_bytes) for e in log.events]

    state, events = gt.launch(body, n)[0]
    step(ref, x)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-12, msg=k)
    ddp = all_reduce_recv_bytes(sum(q.numel() for q in ref.parameters()), 8, n, 0)
    assert events == [("all_reduce", ddp)], events
