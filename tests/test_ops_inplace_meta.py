"""In-place ops that change their target's metadata (squeeze_, unsqueeze_, transpose_, t_, resize_,
addbmm_, as_strided_), the `*_copy` ops, matmul's vector cases, and fallbacks that write more than their target:
values, shapes, strides and gradients equal one device; a fallback never leaves a target's metadata stale."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from globaltensor.ops import clear_cache, registry
from ops_support import check, mesh_placement, meshes, sbps_for

D = torch.float64

# each: (shape, the in-place view on a non-leaf, so autograd records it and the backward runs through it)
IN_PLACE = {
    "squeeze_": ((3, 1, 4), lambda y: y.squeeze_()),
    "squeeze_dim": ((3, 1, 4), lambda y: y.squeeze_(1)),
    "squeeze_dims": ((1, 3, 1, 4), lambda y: y.squeeze_((0, 2))),
    "unsqueeze_": ((3, 4), lambda y: y.unsqueeze_(1)),
    "unsqueeze_last": ((3, 4), lambda y: y.unsqueeze_(-1)),
    "transpose_": ((3, 2, 4), lambda y: y.transpose_(0, 2)),
    "t_": ((3, 4), lambda y: y.t_()),
    "t_square": ((4, 4), lambda y: y.t_()),
    "swapdims_": ((2, 3, 4), lambda y: y.swapdims_(1, 2)),
}


def _in_place(name: str):
    op = IN_PLACE[name][1]

    def fn(x, w):
        y = x * 1
        op(y)
        return y * w.reshape(y.shape) if w.numel() == y.numel() else y, y.sum(0)
    return fn


@given(meshes(), st.sampled_from(sorted(IN_PLACE)), st.data())
def test_in_place_views_match_one_device(mesh, name, data):
    shape = IN_PLACE[name][0]
    sbp = data.draw(sbps_for(mesh, shape))
    torch.manual_seed(0)
    x, w = torch.randn(shape, dtype=D), torch.randn(shape, dtype=D)
    check(_in_place(name), [x, w], mesh, [sbp, data.draw(sbps_for(mesh, shape))])


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_in_place_view_keeps_the_split_strides_and_memory(name):
    """The split travels as the view's (nothing sent), the wrapper's strides are torch's, and the target still
    shares memory with its base: a later write through it reaches the base, as on one device."""
    shape, op = IN_PLACE[name]
    torch.manual_seed(1)
    full = torch.randn(shape, dtype=D)

    def one():
        base = full.clone()
        v = base.view(shape)
        op(v)
        v.mul_(2)
        return base, v.shape, v.stride()
    want_base, want_shape, want_stride = one()
    split = next(d for d, n in enumerate(shape) if n > 1)

    def body():
        base = gt.to_global(full.clone(), mesh_placement((2,)), gt.split(split))
        v = base.view(shape)
        with gt.comm_log() as log:
            op(v)
        v.mul_(2)
        return base.full_tensor(), v.shape, v.stride(), log.recv_bytes, v.sbp
    for got_base, got_shape, got_stride, received, sbp in gt.launch(body, 2):
        assert (got_shape, got_stride) == (want_shape, want_stride)
        assert received == 0 and sbp != (gt.broadcast,)
        torch.testing.assert_close(got_base, want_base)


def test_in_place_view_of_a_view_autograd_records_is_refused():
    """Autograd rebuilds an in-place view of a subclass' view from its base with as_strided and the wrapper's
    strides and offset (torch's own TwoTensor gets y[1:].t_() then mul_ wrong too): refused, not wrong."""
    def body():
        x = gt.to_global(torch.randn(5, 4), mesh_placement((2,)), gt.split(0)).requires_grad_()
        v = (x * 1)[1:]
        v.t_()
    with pytest.raises(NotImplementedError, match="out-of-place view"):
        gt.launch(body, 2)


MATMULS = [((5,), (5, 3)), ((4, 5), (5,)), ((5,), (5,)), ((5,), (2, 5, 3)), ((2, 4, 5), (5,))]


@given(meshes(), st.sampled_from(MATMULS), st.data())
def test_matmul_vector_cases_match_one_device(mesh, shapes, data):
    """torch's matmul of a vector unsqueezes it, multiplies and squeezes the result in place (squeeze_)."""
    sbps = [data.draw(sbps_for(mesh, s)) for s in shapes]
    torch.manual_seed(2)
    check(lambda a, b: torch.matmul(a, b), [torch.randn(s, dtype=D) for s in shapes], mesh, sbps)


@given(meshes(), st.sampled_from([(1,), (10,), (5, 10), (1, 10)]), st.data())
def test_addbmm_in_place_takes_the_result_shape(mesh, self_shape, data):
    """torch's addbmm_ resizes a target that only broadcasts against the result (its CPU kernel does)."""
    torch.manual_seed(5)
    x, a, b = torch.randn(self_shape, dtype=D), torch.randn(3, 5, 4, dtype=D), torch.randn(3, 4, 10, dtype=D)
    want = x.clone().addbmm_(a, b, beta=0.5)
    sbps = [data.draw(sbps_for(mesh, t.shape)) for t in (x, a, b)]

    def body():
        p = mesh_placement(mesh)
        gx, ga, gb = (gt.to_global(t.clone(), p, s) for t, s in zip((x, a, b), sbps))
        assert gx.addbmm_(ga, gb, beta=0.5) is gx and gx.shape == want.shape and gx.stride() == want.stride()
        got = gx.full_tensor()
        return got if gt.rank() in p.flat_ranks else want
    for got in gt.launch(body, mesh.world):
        torch.testing.assert_close(got, want)


RESIZES = [((4, 4, 4), (16, 4)), ((5, 5, 5), (25, 5)), ((6, 4), (5, 3)), ((6, 4), (24,)), ((), (1, 1, 1)),
           ((0,), (3, 2))]


@given(meshes(), st.sampled_from(RESIZES), st.data())
def test_resize_matches_one_device(mesh, sizes, data):
    old, new = sizes
    sbp = data.draw(sbps_for(mesh, old))
    torch.manual_seed(3)
    full = torch.randn(old, dtype=D)
    want = full.clone().resize_(new)

    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(full.clone(), p, sbp)
        y = x.resize_(new)
        assert y is x and tuple(x.shape) == new and x.stride() == want.stride()
        got = x.full_tensor()
        return got if gt.rank() in p.flat_ranks else want  # outside the placement: empty shards
    for got in gt.launch(body, mesh.world):
        if want.numel() and full.numel():  # grown from empty: torch's new elements are uninitialized
            torch.testing.assert_close(got, want)
        assert got.shape == want.shape


def test_resize_sends_only_what_it_must():
    """The same count of elements keeps a split the reshape carries, sending nothing; fewer slices the flattened
    split dim and keeps it split (the recut, ops/view.py): rank 1's 10 elements of the 20 are 10..19, of which it
    held 16..19, so it receives 6 from rank 0 (24 B) and rank 0 nothing, where taking the slice Partial (each rank
    its rows, zeros beside them) would leave the result owing a reduction of all 20."""
    def body():
        p = mesh_placement((2,))
        x = gt.to_global(torch.arange(32.0).reshape(8, 4), p, gt.split(0))
        with gt.comm_log() as log:
            x.resize_(4, 8)
            same, kept = x.sbp, log.recv_bytes
            x.resize_(4, 5)
        return same, kept, log.recv_bytes, x.sbp, x.full_tensor()
    for rank, (same, kept, received, sbp, got) in enumerate(gt.launch(body, 2)):
        assert same == sbp == (gt.split(0),) and kept == 0 and received == [0, 24][rank]
        assert torch.equal(got, torch.arange(20.0).reshape(4, 5))


def test_resize_as_takes_the_template_shape():
    def body():
        x = gt.to_global(torch.arange(24.0).reshape(4, 6), mesh_placement((2,)), gt.split(0))
        x.resize_as_(torch.empty(3, 8))
        return x.full_tensor(), x.shape
    got, shape = gt.launch(body, 2)[0]
    assert shape == (3, 8) and torch.equal(got, torch.arange(24.0).reshape(3, 8))


@pytest.mark.parametrize("case,match", [
    (lambda x: x.resize_(8, 8), "growing a non-empty tensor"),
    (lambda x: x.t_().resize_(24), "not contiguous"),
    (lambda x: x.t().resize_(24), "not contiguous"),
    (lambda x: x.unsqueeze(0).unsqueeze(0).resize_(1, 2, 3, 4, memory_format=torch.channels_last), "memory_format"),
])
def test_resize_refuses_what_it_cannot_compute_exactly(case, match):
    """resize_ reads the storage; where that is not the row-major order of the elements, it raises."""
    def body():
        x = gt.to_global(torch.arange(24.0).reshape(4, 6), mesh_placement((2,)), gt.split(0))
        case(x)
    with pytest.raises(NotImplementedError, match=match):
        gt.launch(body, 2)


@given(meshes(), st.data())
def test_as_strided_in_place_restates_its_target(mesh, data):
    """as_strided_ (ops/strided.py) leaves the target with torch's shape, strides and values."""
    full = torch.arange(20.0, dtype=D).reshape(4, 5)
    sbp = data.draw(sbps_for(mesh, (4, 5)))
    want = full.clone().as_strided_((3, 2), (1, 3), 2)

    def body():
        p = mesh_placement(mesh)
        x = gt.to_global(full.clone(), p, sbp)
        x.as_strided_((3, 2), (1, 3), 2)
        got = x.full_tensor()
        return got if gt.rank() in p.flat_ranks else want, x.shape, x.stride()
    for got, shape, stride in gt.launch(body, mesh.world):
        assert (shape, stride) == (want.shape, want.stride())
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
@pytest.mark.parametrize("name", ["t_square", "transpose_", "squeeze_dim", "unsqueeze_"])
def test_fallback_of_an_in_place_view_is_never_silently_wrong(monkeypatch, mesh, name):
    """Without their rules, in-place views fall back: the target takes the result (shape and strides restated),
    and its base, which only shared memory with it, is not written (a stride-only change, t_ of a square
    matrix, once copied the transposed values into the target's shard, and so into its base)."""
    shape, op = IN_PLACE[name]
    for func in [f for f in list(registry.RULES) if str(f).startswith(("aten.t_.", "aten.transpose_.",
                                                                     "aten.squeeze_.", "aten.unsqueeze_."))]:
        monkeypatch.delitem(registry.RULES, func)
    clear_cache()
    full = torch.randn(shape, dtype=D)
    want = full.clone()
    op(want)
    sbp = (gt.split(0),) + (gt.split(len(shape) - 1),) * (len(mesh) - 1)

    def body():  # on (2,), ranks 2 and 3 are outside the placement: their wrappers must be restated too
        p = mesh_placement(mesh)
        base = gt.to_global(full.clone(), p, sbp)
        v = base.view(shape)
        op(v)
        got, got_base = v.full_tensor(), base.full_tensor()
        inside = gt.rank() in p.flat_ranks
        return (got if inside else want), v.shape, v.stride(), (got_base if inside else full)
    gt.reset_stats()
    try:
        results = gt.launch(body, 4)
        fallbacks = dict(gt.stats()["fallback"])
    finally:
        monkeypatch.undo()
        clear_cache()
    assert fallbacks, "expected the in-place view to fall back"
    for got, shape_, stride, base in results:
        assert (shape_, stride) == (want.shape, want.stride())
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(base, full)


def test_fallback_writes_back_every_tensor_its_op_writes():
    """rrelu (training) draws its noise into a tensor its op writes besides its result; the backward reads it.
    Its fallback ran on a gathered copy of the noise, so the backward read a noise never written."""
    torch.manual_seed(0)
    x0 = torch.randn(6, 4, dtype=D)

    def rrelu(x):
        torch.manual_seed(1)
        return torch.nn.functional.rrelu(x, training=True)
    for mesh in [(2,), (2, 2)]:
        check(rrelu, [x0], mesh, [(gt.split(0),) * len(mesh)])


COPIES = {
    "view_copy": ((4, 6), lambda x: torch.view_copy(x, (2, 12))),
    "permute_copy": ((2, 3, 4), lambda x: torch.permute_copy(x, (2, 0, 1))),
    "t_copy": ((3, 4), lambda x: torch.t_copy(x)),
    "transpose_copy": ((2, 3, 4), lambda x: torch.transpose_copy(x, 0, 2)),
    "squeeze_copy": ((3, 1, 4), lambda x: torch.squeeze_copy(x)),
    "squeeze_copy_dim": ((3, 1, 4), lambda x: torch.squeeze_copy(x, 1)),
    "unsqueeze_copy": ((3, 4), lambda x: torch.unsqueeze_copy(x, 1)),
    "expand_copy": ((3, 1), lambda x: torch.expand_copy(x, (2, 3, 4))),
    "alias_copy": ((3, 4), lambda x: torch.alias_copy(x)),
    "narrow_copy": ((4, 6), lambda x: torch.narrow_copy(x, 1, 1, 3)),
    "split_with_sizes_copy": ((4, 6), lambda x: torch.split_with_sizes_copy(x, [2, 4], 1)),
    "unbind_copy": ((2, 5), lambda x: torch.unbind_copy(x, 0)),
    "unsafe_split": ((4, 6), lambda x: torch.unsafe_split(x, 4, 1)),
    "unsafe_chunk": ((4, 6), lambda x: torch.unsafe_chunk(x, 2, 0)),
}


@given(meshes(), st.sampled_from(sorted(COPIES)), st.data())
def test_copies_match_one_device_without_fallback(mesh, name, data):
    shape, fn = COPIES[name]
    sbp = data.draw(sbps_for(mesh, shape, partial=True))
    torch.manual_seed(4)
    gt.reset_stats()
    check(fn, [torch.randn(shape, dtype=D)], mesh, [sbp])
    assert not gt.stats()["fallback"], gt.stats()["fallback"]


@pytest.mark.parametrize("name", ["view_copy", "squeeze_copy", "unsqueeze_copy", "permute_copy", "alias_copy"])
def test_copies_do_not_share_memory_with_their_input(name):
    shape, fn = COPIES[name]
    full = torch.randn(shape, dtype=D)

    def body():
        x = gt.to_global(full.clone(), mesh_placement((2,)), gt.split(0))
        y = fn(x)
        y.add_(1)
        return x.full_tensor()
    for got in gt.launch(body, 2):
        torch.testing.assert_close(got, full)
