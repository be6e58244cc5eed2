"""Strides and as_strided (issue 34): a GlobalTensor's wrapper carries one device's strides and storage offset,
and as_strided (as_strided_, as_strided_copy, as_strided_scatter) reads the positions one device reads.

Over shapes, chains of transposes, slices, selects and expands, and layouts on 1-D meshes of 2-4 ranks and
2x2: `stride()`, `storage_offset()`, `is_contiguous()` and whether `.view(-1)` raises equal plain torch's;
as_strided of a geometry inside the tensor's own elements equals plain torch in value and gradient, and one
reaching elsewhere in the storage raises, naming as_strided and the fix.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from ops_support import mesh_placement, sbps_for

D = torch.float64
MESHES = [(2,), (3,), (4,), (2, 2)]


def _apply(x: torch.Tensor, chain: list) -> torch.Tensor:
    for op, *a in chain:
        if op == "t":
            x = x.transpose(a[0], a[1])
        elif op == "slice":
            d, start, step = a
            x = x[(slice(None),) * d + (slice(start, None, step),)]
        elif op == "select":
            x = x.select(a[0], a[1])
        elif op == "expand":
            d, n = a
            x = x.unsqueeze(d).expand(*x.shape[:d], n, *x.shape[d:])
        elif op == "add":  # a fresh tensor whose strides follow its input's (TensorIterator keeps the layout)
            x = x + 1
    return x


@st.composite
def chains(draw, shape: tuple, n: int = 3) -> list:
    """Up to n view steps valid for `shape` (tracked on a meta tensor)."""
    x = torch.empty(shape, device="meta")
    chain = []
    for _ in range(draw(st.integers(0, n))):
        choices = ["expand", "add"]
        if x.dim() >= 2:
            choices.append("t")
        if any(s > 1 for s in x.shape):
            choices.append("slice")
        if x.dim() >= 2:
            choices.append("select")
        op = draw(st.sampled_from(choices))
        if op == "t":
            i, j = draw(st.permutations(range(x.dim())))[:2]
            step = ("t", i, j)
        elif op == "slice":
            d = draw(st.sampled_from([d for d in range(x.dim()) if x.shape[d] > 1]))
            step = ("slice", d, draw(st.integers(0, x.shape[d] - 1)), draw(st.integers(1, 2)))
        elif op == "select":
            d = draw(st.integers(0, x.dim() - 1))
            step = ("select", d, draw(st.integers(0, x.shape[d] - 1)))
        elif op == "expand":
            step = ("expand", draw(st.integers(0, x.dim())), draw(st.integers(1, 3)))
        else:
            step = ("add",)
        chain.append(step)
        x = _apply(x, [step])
    return chain


def _outcome(f):
    """f()'s value, or the type of what it raised."""
    try:
        return f()
    except Exception as e:  # noqa: BLE001
        return type(e)


def _run(full: torch.Tensor, mesh: tuple, sbp: tuple, body):
    def on_rank():
        p = mesh_placement(mesh)
        x = gt.to_global(full.clone(), p, sbp).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return body(x, p)
    return gt.launch(on_rank, len(mesh_placement(mesh).flat_ranks))[0]


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.is_contiguous()


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(MESHES), st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), st.data())
def test_strides_contiguity_and_view_legality_equal_one_device(mesh, shape, data):
    chain = data.draw(chains(shape))
    sbp = data.draw(sbps_for(mesh, shape))
    full = torch.randn(shape, dtype=D)
    want = _apply(full, chain)
    want_view = _outcome(lambda: want.view(-1).clone())

    def body(x, p):
        y = _apply(x, chain)
        return _geometry(y), _outcome(lambda: y.view(-1).full_tensor()), y.full_tensor()
    geometry, view, value = _run(full, mesh, sbp, body)
    assert geometry == _geometry(want), chain
    assert torch.equal(value, want.detach())
    if isinstance(want_view, type):
        assert view is want_view, f"plain torch raises {want_view.__name__} on .view(-1), the global one gave {view}"
    else:
        assert torch.equal(view, want_view.detach())


def _positions(size, stride, offset) -> set:
    pos = torch.full((), offset, dtype=torch.int64)
    for n, s in zip(size, stride):
        pos = pos.unsqueeze(-1) + torch.arange(n) * s
    return set(pos.reshape(-1).tolist())


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(MESHES), st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), st.data())
def test_as_strided_equals_one_device_or_raises_by_name(mesh, shape, data):
    chain = data.draw(chains(shape))
    sbp = data.draw(sbps_for(mesh, shape, partial=True))
    full = torch.randn(shape, dtype=D)
    y_meta = _apply(torch.empty(shape, device="meta"), chain)
    if data.draw(st.booleans()):  # a view of y: always among y's elements
        steps = [s for s in data.draw(chains(tuple(y_meta.shape), 2)) if s[0] != "add"]
        z = _apply(y_meta, steps)
        size, stride, offset = tuple(z.shape), z.stride(), z.storage_offset()
    else:  # anywhere in the base's storage (y's storage when a chain step made a fresh tensor)
        ndim = data.draw(st.integers(1, 2))
        # sizes from 1: torch's as_strided backward of an empty output is a zeros factory, a plain tensor
        size = tuple(data.draw(st.integers(1, 3)) for _ in range(ndim))
        stride = tuple(data.draw(st.integers(0, 4)) for _ in range(ndim))
        offset = data.draw(st.integers(0, 4))
    inside = _positions(size, stride, offset) <= _positions(y_meta.shape, y_meta.stride(), y_meta.storage_offset())
    w = full.clone().requires_grad_()
    want = _outcome(lambda: _apply(w, chain).as_strided(size, stride, offset))
    if isinstance(want, type):  # plain torch refuses (out of its storage's bounds): so must we
        got = _run(full, mesh, sbp, lambda x, p: _outcome(lambda: _apply(x, chain).as_strided(size, stride, offset)))
        assert isinstance(got, type), f"plain torch raises {want.__name__}, the global as_strided gave a value"
        return
    weights = torch.randn(size, dtype=D)
    (want * weights).sum().backward()

    def body(x, p):
        try:
            out = _apply(x, chain).as_strided(size, stride, offset)
        except NotImplementedError as e:
            return str(e)
        (out * gt.to_global(weights, p, (gt.broadcast,) * len(p.shape))).sum().backward()
        return out.full_tensor(), (out.stride(), out.storage_offset()), x.grad.full_tensor()
    got = _run(full, mesh, sbp, body)
    if not inside:
        assert isinstance(got, str) and "as_strided" in got and ".contiguous()" in got, got
        return
    assert not isinstance(got, str), got
    value, geometry, grad = got
    torch.testing.assert_close(value, want.detach())
    assert geometry == (want.stride(), want.storage_offset())
    torch.testing.assert_close(grad, w.grad)


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("sbp_dim", [None, 0, 1])
def test_as_strided_kin_equal_one_device(mesh, sbp_dim):
    """as_strided_copy, as_strided_scatter and as_strided_ of non-contiguous inputs, values and gradients."""
    torch.manual_seed(0)
    full, src = torch.randn(4, 6, dtype=D), torch.randn(2, 3, dtype=D)
    cases = {
        "copy": lambda a, s: torch.as_strided_copy(a.t(), (2, 3), (1, 4), 1),
        "scatter": lambda a, s: torch.as_strided_scatter(a * 1, s, (2, 3), (1, 4), 1),
        "in_place": lambda a, s: (a.t() * 1).as_strided_((2, 3), (1, 4), 1) * 1,
        "in_place_slice": lambda a, s: (a * 1)[1:].as_strided_((2, 3), (6, 1)) * 1,
    }
    sbp = (gt.broadcast if sbp_dim is None else gt.split(sbp_dim),) * len(mesh)
    for name, f in cases.items():
        w, ws = full.clone().requires_grad_(), src.clone().requires_grad_()
        want = f(w, ws)
        weights = torch.randn(want.shape, dtype=D)
        (want * weights).sum().backward()

        def body(x, p):
            xs = gt.to_global(src.clone(), p, (gt.broadcast,) * len(p.shape)).requires_grad_()
            out = f(x, xs)
            (out * gt.to_global(weights, p, (gt.broadcast,) * len(p.shape))).sum().backward()
            return (out.full_tensor(), (out.stride(), out.storage_offset()), x.grad.full_tensor(),
                    None if xs.grad is None else xs.grad.full_tensor())
        value, geometry, grad, src_grad = _run(full, mesh, sbp, body)
        torch.testing.assert_close(value, want.detach(), msg=name)
        assert geometry == (want.stride(), want.storage_offset()), name
        torch.testing.assert_close(grad, w.grad, msg=name)
        if ws.grad is not None:
            torch.testing.assert_close(src_grad, ws.grad, msg=name)


def test_writing_into_a_gathered_as_strided_raises_and_a_broadcast_one_writes_through():
    """A split tensor's as_strided is a gathered copy: a write into it raises (it would not reach the tensor).
    A Broadcast tensor's is a true view of its shard: the write reaches the tensor, as on one device."""
    full = torch.arange(24.0).reshape(4, 6)
    want = full.clone()
    want.t().as_strided((2, 2), (1, 6), 1).add_(100)

    def split(x, p):
        z = x.detach().t().as_strided((2, 2), (1, 6), 1)
        return _outcome(lambda: z.add_(100))
    assert _run(full, (2,), (gt.split(0),), split) is RuntimeError

    def whole(x, p):
        base = x.detach().clone()
        base.t().as_strided((2, 2), (1, 6), 1).add_(100)
        return base.full_tensor()
    assert torch.equal(_run(full, (2,), (gt.broadcast,), whole), want)


def test_outside_the_elements_raises_naming_as_strided_and_the_fix():
    def body(x, p):
        return _outcome(lambda: x[1:].as_strided((2,), (1,), 0))
    assert _run(torch.randn(4, 6), (2,), (gt.split(0),), body) is NotImplementedError
    with pytest.raises(NotImplementedError, match=r"as_strided.*\.contiguous\(\)"):
        gt.launch(lambda: gt.to_global(torch.randn(4, 6), mesh_placement((2,)), gt.split(0))[1:]
                  .as_strided((2,), (1,), 0), 2)


@pytest.mark.parametrize("weights_only", [False, True])
def test_save_load_and_deepcopy_keep_the_strides(tmp_path, weights_only):
    """A saved transposed slice loads (and deep-copies) with one device's strides and offset, so an
    as_strided of it reads the same positions after the round trip."""
    full = torch.arange(24.0).reshape(4, 6)
    want = full.t()[1:]

    def body():
        p = mesh_placement((2,))
        y = gt.to_global(full, p, gt.split(0)).t()[1:]
        path = tmp_path / f"rank{gt.rank()}.pt"
        torch.save(y, path)
        back = torch.load(path, weights_only=weights_only)
        dup = copy.deepcopy(y)
        return [(t.stride(), t.storage_offset(), t.as_strided((2, 2), (1, 6), 7).full_tensor()) for t in (back, dup)]
    for stride, offset, read in gt.launch(body, 2)[0]:
        assert (stride, offset) == (want.stride(), want.storage_offset())
        assert torch.equal(read, want.as_strided((2, 2), (1, 6), 7))
