"""Vision and audio layers on split tensors (ops/conv.py, ops/spatial.py, ops/channel_norm.py): values and
gradients equal one device's on any layout, and the layouts real models use compute where they are:

- convolution split on the batch (data parallel: the weight's gradient Partial, one all-reduce of it),
  on the output channels (column-parallel: no traffic forward, the input's gradient Partial), on the input
  channels (row-parallel: the output Partial, the bias added once), depthwise on whole groups (no traffic);
- pools, upsampling, pads, shuffles, grid sampling, GLU, PReLU on their (batch, channel) planes;
- group norm on the batch or on whole groups; batch norm's aten forms.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import check, mesh_placement, meshes, world_of

TOL = dict(rtol=1e-9, atol=1e-9)  # float64: a split sum reorders additions only
ONE_D = [(2,), (3,), (4,)]


def _layouts(draw, mesh: tuple, choices: list) -> tuple:
    return tuple(draw(st.sampled_from(choices)) for _ in mesh)


@given(meshes(ONE_D + [(2, 2)]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.booleans(),
       st.booleans(), st.data())
def test_convolution_matches_one_device(mesh, spatial, groups, transposed, bias, data):
    """conv1d/2d (and transposed), groups 1, 2 or depthwise, with or without bias, every input laid out at
    random (batch, channel or no split): values and every gradient as on one device."""
    n, cin = data.draw(st.sampled_from([1, 3, 4])), 4
    cout = data.draw(st.sampled_from([4, 8]))
    size = (5,) * spatial
    k = (2,) * spatial
    torch.manual_seed(0)
    x = torch.randn(n, cin, *size, dtype=torch.float64)
    w = torch.randn(*((cin, cout // groups) if transposed else (cout, cin // groups)), *k, dtype=torch.float64)
    b = torch.randn(cout, dtype=torch.float64)
    conv = {(1, False): F.conv1d, (2, False): F.conv2d, (1, True): F.conv_transpose1d,
            (2, True): F.conv_transpose2d}[(spatial, transposed)]
    split = [gt.broadcast, gt.split(0), gt.split(1)]
    sbps = [_layouts(data.draw, mesh, split), _layouts(data.draw, mesh, split),
            _layouts(data.draw, mesh, [gt.broadcast, gt.split(0)])]
    inputs = [x, w, b] if bias else [x, w]
    check(lambda *t: conv(*t, stride=1, padding=1, groups=groups), inputs, mesh, sbps[:len(inputs)], **TOL)


def _run(fn, inputs: list, mesh: tuple, sbps: list, backward: bool = True):
    """fn on GlobalTensors: per rank, (output SBP, forward events, backward events, the reduced gradients'
    events, full output, full gradients)."""
    def body():
        p = mesh_placement(mesh)
        xs = [gt.to_global(t, p, s).requires_grad_(True) for t, s in zip(inputs, sbps)]
        with gt.comm_log() as fwd:
            y = fn(*xs)
        bwd = gt.comm_log()
        with bwd as blog:
            if backward:
                torch.manual_seed(1)
                # the loss's weights laid out as the output (a Partial one's: Broadcast), so the output's
                # gradient arrives in its layout, as a model's split loss gives it
                r = gt.to_global(torch.randn(y.shape, dtype=y.dtype), p,
                                 tuple(gt.broadcast if isinstance(s, gt.Partial) else s for s in y.sbp))
                (y * r).sum().backward()
        grads = [x.grad for x in xs] if backward else []
        sbp_grads = [None if g is None else g.sbp for g in grads]
        with gt.comm_log() as reduce:
            full_grads = [None if g is None else g.full_tensor() for g in grads]
        with gt.comm_log() as gather:
            full = y.full_tensor()
        ev = lambda log: [(e.kind, e.recv_bytes) for e in log.events]  # noqa: E731
        return y.sbp, ev(fwd), ev(blog), ev(reduce), ev(gather), full, full_grads, sbp_grads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gt.launch(body, world_of(mesh))


def _ring_all_reduce(numel: int, itemsize: int, n: int) -> int:
    """What each rank receives in a ring all-reduce of `numel` elements (n divides it): 2(n-1)/n of them."""
    assert numel % n == 0
    return 2 * (n - 1) * numel // n * itemsize


def _gather(numel: int, itemsize: int, n: int) -> int:
    """What each rank receives in an all-gather of n equal shards of `numel` elements."""
    return (n - 1) * numel // n * itemsize


@given(st.sampled_from([2, 4]), st.sampled_from([1, 2]))
def test_data_parallel_conv_reduces_the_weight_gradient_once(n, spatial):
    """x S(0), weight and bias Broadcast: the output stays S(0) with nothing sent; the weight's and bias'
    gradients are Partial (each rank's samples' share), reduced by one ring all-reduce each."""
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 3, *(6,) * spatial), torch.randn(8, 3, *(3,) * spatial), torch.randn(8)
    conv = F.conv1d if spatial == 1 else F.conv2d
    results = _run(lambda *t: conv(*t, padding=1), [x, w, b], (n,), [(gt.split(0),), (gt.broadcast,),
                                                                       (gt.broadcast,)])
    want = conv(x, w, b, padding=1)
    for sbp, fwd, bwd, reduce, _, full, grads, grad_sbps in results:
        assert sbp == (gt.split(0),) and fwd == [] and bwd == []
        assert grad_sbps == [(gt.split(0),), (gt.partial_sum,), (gt.partial_sum,)]
        assert reduce == [("all_gather", _gather(x.numel(), 4, n)), ("all_reduce", _ring_all_reduce(w.numel(), 4, n)),
                          ("all_reduce", _ring_all_reduce(b.numel(), 4, n))]
        torch.testing.assert_close(full, want)


@given(st.sampled_from([2, 4]))
def test_column_parallel_conv_splits_output_channels(n):
    """x Broadcast, weight S(0), bias S(0) (Megatron's column-parallel, for a conv): the output is split on
    its channels with nothing sent; the input's gradient is Partial, one all-reduce."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(8, 3, 3, 3), torch.randn(8)
    results = _run(lambda *t: F.conv2d(*t, padding=1), [x, w, b], (n,), [(gt.broadcast,), (gt.split(0),),
                                                                          (gt.split(0),)])
    for sbp, fwd, bwd, reduce, gather, full, grads, grad_sbps in results:
        assert sbp == (gt.split(1),) and fwd == [] and bwd == []
        assert grad_sbps == [(gt.partial_sum,), (gt.split(0),), (gt.split(0),)]
        assert reduce[0] == ("all_reduce", _ring_all_reduce(x.numel(), 4, n))
        assert gather == [("all_gather", _gather(2 * 8 * 8 * 8, 4, n))]
        torch.testing.assert_close(full, F.conv2d(x, w, b, padding=1))


@given(st.sampled_from([2, 4]), st.booleans())
def test_row_parallel_conv_gives_a_partial_output_with_one_bias(n, transposed):
    """x S(1), weight split on its input channels: the output is Partial (the sum over the input channels
    being cut), the bias on one rank only (so it is added once); its reduction is one ring all-reduce."""
    torch.manual_seed(0)
    x, b = torch.randn(2, 8, 6, 6), torch.randn(4)
    w = torch.randn(8, 4, 3, 3) if transposed else torch.randn(4, 8, 3, 3)
    conv = F.conv_transpose2d if transposed else F.conv2d
    w_sbp = (gt.split(0),) if transposed else (gt.split(1),)
    results = _run(lambda *t: conv(*t, padding=1), [x, w, b], (n,), [(gt.split(1),), w_sbp, (gt.broadcast,)])
    want = conv(x, w, b, padding=1)
    for sbp, fwd, bwd, reduce, gather, full, grads, grad_sbps in results:
        assert sbp == (gt.partial_sum,) and fwd == [] and bwd == []
        assert grad_sbps[:2] == [(gt.split(1),), w_sbp]
        assert gather == [("all_reduce", _ring_all_reduce(want.numel(), 4, n))]
        torch.testing.assert_close(full, want)


@given(meshes(ONE_D, extra_ranks=1), st.sampled_from([1, 2]))
def test_depthwise_conv_on_whole_groups_sends_nothing(mesh, multiplier):
    """groups = channels (depthwise, `multiplier` outputs each), x S(1), weight and bias S(0): where every
    rank holds whole groups (the channels divide evenly) the output is S(1) with nothing sent, forward
    or backward; values and gradients as one device (an uneven split takes another choice)."""
    n = mesh[0]
    c = 12
    torch.manual_seed(0)
    x, w, b = (torch.randn(2, c, 7, dtype=torch.float64), torch.randn(c * multiplier, 1, 3, dtype=torch.float64),
               torch.randn(c * multiplier, dtype=torch.float64))
    fn = lambda *t: F.conv1d(*t, padding=1, groups=c)  # noqa: E731
    results = _run(fn, [x, w, b], mesh, [(gt.split(1),), (gt.split(0),), (gt.split(0),)])
    want = fn(x, w, b)
    for rank, (sbp, fwd, bwd, _, _, full, grads, grad_sbps) in enumerate(results):
        if rank not in mesh.ranks:
            continue
        if c % n == 0:
            assert sbp == (gt.split(1),) and fwd == [] and bwd == []
            assert grad_sbps == [(gt.split(1),), (gt.split(0),), (gt.split(0),)]
        torch.testing.assert_close(full, want)
    check(fn, [x, w, b], mesh, [(gt.split(1),), (gt.split(0),), (gt.split(0),)], **TOL)


# -- pools, upsampling, pads and friends: split on their planes ----------------------------------------------
GRID = torch.rand(3, 4, 5, 2, dtype=torch.float64) * 2 - 1
PLANES = {
    "avg_pool2d": lambda x: F.avg_pool2d(x, 2, ceil_mode=True),
    "max_pool2d": lambda x: F.max_pool2d(x, 3, stride=2, padding=1),
    "max_pool1d": lambda x: F.max_pool1d(x.flatten(2), 4),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
    "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, 3),
    "avg_pool3d": lambda x: F.avg_pool3d(x.unsqueeze(2).expand(-1, -1, 2, -1, -1), (1, 2, 2)),
    "nearest": lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
    "bilinear": lambda x: F.interpolate(x, size=(7, 9), mode="bilinear", align_corners=False),
    "bicubic": lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic", align_corners=True),
    "linear": lambda x: F.interpolate(x.flatten(2), scale_factor=1.7, mode="linear"),
    "nearest_exact": lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact"),
    "nearest3d": lambda x: F.interpolate(x.unsqueeze(2), scale_factor=(1, 2, 2), mode="nearest"),
    "reflect": lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"),
    "reflect3d": lambda x: F.pad(x.unsqueeze(2).expand(-1, -1, 3, -1, -1), (1,) * 6, mode="reflect"),
    "replicate3d": lambda x: F.pad(x.unsqueeze(2), (1, 1, 2, 1, 1, 0), mode="replicate"),
    "replicate": lambda x: F.pad(x.flatten(2), (3, 1), mode="replicate"),
    "pixel_shuffle": lambda x: F.pixel_shuffle(x.repeat(1, 4, 1, 1), 2),
    "pixel_unshuffle": lambda x: F.pixel_unshuffle(x[..., :4, :4], 2),
    "channel_shuffle": lambda x: F.channel_shuffle(x, 2),
    "glu": lambda x: F.glu(x, dim=-1),
    "unfold": lambda x: F.unfold(x, 2),
    "fold": lambda x: F.fold(x.flatten(2)[..., :16], (5, 5), 2),
    "grid_sample": lambda x: F.grid_sample(x[:3] if x.shape[0] >= 3 else x.expand(3, -1, -1, -1), GRID,
                                           align_corners=False),
}


@given(meshes(ONE_D + [(2, 2)]), st.sampled_from(sorted(PLANES)), st.data())
def test_plane_ops_match_one_device(mesh, name, data):
    """Each op on x [N, C, 5, 6] laid out at random (batch, channels, spatial, Broadcast): values and the
    input's gradient as one device."""
    torch.manual_seed(0)
    x = torch.randn(data.draw(st.sampled_from([3, 4])), 4, 5, 6, dtype=torch.float64)
    sbp = _layouts(data.draw, mesh, [gt.broadcast, gt.split(0), gt.split(1), gt.split(2)])
    check(PLANES[name], [x], mesh, [sbp], **TOL)


@given(st.sampled_from([2, 4]), st.sampled_from(["avg_pool2d", "max_pool2d", "adaptive_avg_pool2d", "bilinear",
                                                 "reflect", "nearest", "adaptive_max_pool2d"]),
       st.sampled_from([0, 1]))
def test_plane_ops_keep_a_batch_or_channel_split(n, name, dim):
    """Split on the batch or the channels (4 of each: whole on every rank), the op keeps the split and
    sends nothing, forward or backward."""
    torch.manual_seed(0)
    x = torch.randn(4, 4, 5, 6, dtype=torch.float64)
    for sbp, fwd, bwd, _, _, full, grads, grad_sbps in _run(PLANES[name], [x], (n,), [(gt.split(dim),)]):
        assert sbp == (gt.split(dim),) and fwd == [] and bwd == [] and grad_sbps == [(gt.split(dim),)]
        torch.testing.assert_close(full, PLANES[name](x))


@given(meshes(ONE_D), st.sampled_from([2, 3]), st.sampled_from([0, 1]))
def test_fractional_max_pool_with_its_samples_matches_one_device(mesh, spatial, dim):
    """The random samples [N, C, 2 or 3] given, split with the planes: the same windows as one device."""
    torch.manual_seed(0)
    shape = (4, 3) + (7,) * spatial
    x = torch.randn(shape, dtype=torch.float64)
    samples = torch.rand(4, 3, spatial, dtype=torch.float64)
    pool = F.fractional_max_pool2d if spatial == 2 else F.fractional_max_pool3d
    fn = lambda x, s: pool(x, 2, output_size=(3,) * spatial, _random_samples=s)  # noqa: E731
    check(fn, [x, samples], mesh, [(gt.split(dim),) * len(mesh), (gt.split(dim),) * len(mesh)], grad=False,
          **TOL)
    check(lambda x: fn(x, samples), [x], mesh, [(gt.split(dim),) * len(mesh)], **TOL)


def test_prelu_per_channel_weight_follows_a_channel_split():
    """PReLU's weight is per channel: with x S(1) and the weight S(0) the output is S(1) and the weight's
    gradient S(0), nothing sent; with x S(0) the weight's gradient is Partial (each rank's samples' sum)."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, 5, dtype=torch.float64), torch.rand(6, dtype=torch.float64)
    for sbp, fwd, bwd, _, _, full, grads, grad_sbps in _run(F.prelu, [x, w], (2,), [(gt.split(1),), (gt.split(0),)]):
        assert sbp == (gt.split(1),) and fwd == [] and bwd == [] and grad_sbps == [(gt.split(1),), (gt.split(0),)]
    for sbp, fwd, bwd, _, _, full, grads, grad_sbps in _run(F.prelu, [x, w], (2,), [(gt.split(0),), (gt.broadcast,)]):
        assert sbp == (gt.split(0),) and grad_sbps == [(gt.split(0),), (gt.partial_sum,)]
    check(F.prelu, [x, w], (3,), [(gt.split(1),), (gt.split(0),)], **TOL)


# -- group norm and batch norm ------------------------------------------------------------------------------
@given(meshes(ONE_D + [(2, 2)]), st.sampled_from([1, 2, 4, 8]), st.data())
def test_group_norm_matches_one_device(mesh, groups, data):
    """x [N, 8, 5] and the affine parameters laid out at random: values and gradients as one device."""
    torch.manual_seed(0)
    x = torch.randn(data.draw(st.sampled_from([2, 5])), 8, 5, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    vec = [gt.broadcast, gt.split(0)]
    sbps = [_layouts(data.draw, mesh, [gt.broadcast, gt.split(0), gt.split(1)]), _layouts(data.draw, mesh, vec),
            _layouts(data.draw, mesh, vec)]
    check(lambda *t: F.group_norm(t[0], groups, t[1], t[2]), [x, w, b], mesh, sbps, **TOL)


@given(st.sampled_from([2, 4]), st.sampled_from([4, 8]))
def test_group_norm_on_whole_groups_sends_nothing(n, groups):
    """Channels split so that each rank holds whole groups (8 channels, 4 or 8 groups over 2 or 4 ranks):
    output and gradients keep the channel split, nothing sent."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, 5, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    fn = lambda *t: F.group_norm(t[0], groups, t[1], t[2])  # noqa: E731
    for sbp, fwd, bwd, _, _, full, grads, grad_sbps in _run(fn, [x, w, b], (n,),
                                                           [(gt.split(1),), (gt.split(0),), (gt.split(0),)]):
        assert sbp == (gt.split(1),) and fwd == [] and bwd == []
        assert grad_sbps == [(gt.split(1),), (gt.split(0),), (gt.split(0),)]
        torch.testing.assert_close(full, fn(x, w, b))


FORMS = {  # batch norm's aten forms: (x, w, b, running mean, running var) -> (out, running mean, running var)
    "with_update": lambda x, w, b, rm, rv: torch.ops.aten._batch_norm_with_update(x, w, b, rm, rv, 0.1, 1e-5)[0],
    "legit_train": lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit(x, w, b, rm, rv, True, 0.1,
                                                                                   1e-5)[0],
    "legit_eval": lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit(x, w, b, rm, rv, False, 0.1,
                                                                                  1e-5)[0],
    "no_training": lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit_no_training(x, w, b, rm, rv,
                                                                                               0.1, 1e-5)[0],
    "no_stats": lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1,
                                                                                         1e-5)[0],
    "no_update": lambda x, w, b, rm, rv: torch.ops.aten._batch_norm_no_update(x, w, b, rm, rv, 0.1, 1e-5)[0],
}


@given(meshes(ONE_D), st.sampled_from([0, 1]), st.sampled_from(sorted(FORMS)))
def test_batch_norm_aten_forms_match_one_device(mesh, dim, form):
    """Batch norm's aten forms, split on the batch or the channels: outputs, running statistics (updated in
    place by the training forms) and gradients as one device."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, 5, dtype=torch.float64)
    w, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5

    def fn(x, w, b):
        # the running statistics on x's placement (Broadcast)
        run = [t.clone() if not isinstance(x, gt.GlobalTensor) else
               gt.to_global(t.clone(), x.placement, (gt.broadcast,) * len(mesh)) for t in (rm, rv)]
        return FORMS[form](x, w, b, *run), run[0] * 1, run[1] * 1
    sbp = (gt.split(dim),) * len(mesh)
    check(fn, [x, w, b], mesh, [sbp] + [(gt.broadcast,) * len(mesh)] * 2, **TOL)


@given(meshes(ONE_D + [(2, 2)]), st.sampled_from(["sum", "mean", "max"]), st.booleans(), st.data())
def test_embedding_bag_matches_one_device(mesh, mode, weighted, data):
    """A table [10, 6] laid out at random (its columns split, its rows, whole), bags of indices: the output,
    the table's gradient and the per-sample weights' gradient (sum mode) as one device."""
    torch.manual_seed(0)
    table = torch.randn(10, 6, dtype=torch.float64)
    idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0]), torch.tensor([0, 4, 4, 7])
    psw = torch.rand(9, dtype=torch.float64)
    weighted = weighted and mode == "sum"
    sbp = _layouts(data.draw, mesh, [gt.broadcast, gt.split(0), gt.split(1)])
    if weighted:
        fn = lambda t, w: F.embedding_bag(idx, t, offsets, mode=mode, per_sample_weights=w)  # noqa: E731
        check(fn, [table, psw], mesh, [sbp, (gt.broadcast,) * len(mesh)], **TOL)
    else:
        check(lambda t: F.embedding_bag(idx, t, offsets, mode=mode), [table], mesh, [sbp], **TOL)


def test_embedding_bag_on_split_columns_sends_nothing():
    """A table split on its columns: the output is split alike and the table's gradient too, nothing sent."""
    torch.manual_seed(0)
    table = torch.randn(10, 6)
    idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    for mode in ("sum", "max"):
        fn = lambda t: F.embedding_bag(idx, t, offsets, mode=mode)  # noqa: E731
        for sbp, fwd, bwd, _, _, full, grads, grad_sbps in _run(fn, [table], (2,), [(gt.split(1),)]):
            assert sbp == (gt.split(1),) and fwd == [] and bwd == [] and grad_sbps == [(gt.split(1),)]
            torch.testing.assert_close(full, fn(table))


# -- a spatial (sequence) split: the halo exchange (ops/halo.py) --------------------------------------------------
def _blocks(length: int, n: int) -> list:
    """Each rank's rows of a balanced split of `length` over n, as sets (an independent count of the boxes)."""
    base, extra = divmod(length, n)
    starts = [r * base + min(r, extra) for r in range(n + 1)]
    return [set(range(starts[r], starts[r + 1])) for r in range(n)]


def _lacked_rows(length: int, out_length: int, n: int, stride: int, pad: int, reach: int) -> list:
    """Per rank: the input rows its block of outputs reads (inside the input) that it does not hold."""
    own, outs = _blocks(length, n), _blocks(out_length, n)
    return [len({t * stride - pad + j for t in outs[r] for j in range(reach + 1)} & set(range(length)) - own[r])
            for r in range(n)]


@given(meshes(ONE_D + [(2, 2)]), st.sampled_from([1, 2]), st.data())
def test_convolution_over_a_split_spatial_dim_matches_one_device(mesh, spatial, data):
    """conv1d/conv2d with the input split on a spatial dim (and, on a 2x2 mesh, the batch or that dim again on
    the other axis), any kernel, stride, dilation, padding, groups 1 or depthwise: values and every gradient
    as on one device, the output keeping the split where the halo is the cheapest way."""
    d = 2 + data.draw(st.integers(0, spatial - 1))
    k, stride, dil = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    pad = data.draw(st.integers(0, dil * (k - 1)))
    length = data.draw(st.integers(max(1, dil * (k - 1) + 1 - 2 * pad), 17))
    groups, c = data.draw(st.sampled_from([1, 4])), 4
    torch.manual_seed(0)
    x = torch.randn(2, c, *[length if i + 2 == d else 3 for i in range(spatial)], dtype=torch.float64)
    w = torch.randn(4, c // groups, *[k if i + 2 == d else 1 for i in range(spatial)], dtype=torch.float64)
    b = torch.randn(4, dtype=torch.float64)
    conv = F.conv1d if spatial == 1 else F.conv2d
    x_sbp = (gt.split(d),) + tuple(data.draw(st.sampled_from([gt.split(d), gt.split(0), gt.broadcast]))
                                   for _ in mesh[1:])
    check(lambda *t: conv(*t, stride=stride, padding=pad, dilation=dil, groups=groups), [x, w, b], mesh,
          [x_sbp, (gt.broadcast,) * len(mesh), (gt.broadcast,) * len(mesh)], **TOL)


@given(st.sampled_from([2, 3, 4]), st.sampled_from([3, 5]))
def test_same_conv_over_a_sequence_split_moves_only_each_blocks_halo(n, k):
    """A "same" conv1d (padding (k-1)/2) with the sequence split: the output stays split; each rank receives
    the (k-1)/2 rows on each side of its block that its windows read, from its neighbours (the halo); the
    backward receives them again with the gradient of its rows its neighbours' windows read. The weight's
    and bias's gradients are each rank's outputs' share: Partial, one ring all-reduce each."""
    torch.manual_seed(0)
    batch, c, length, p = 2, 3, 24, (k - 1) // 2
    x, w, b = torch.randn(batch, c, length), torch.randn(12, c, k), torch.randn(12)
    results = _run(lambda *t: F.conv1d(*t, padding=p), [x, w, b], (n,), [(gt.split(2),), (gt.broadcast,),
                                                                         (gt.broadcast,)])
    row = batch * c * 4
    halos = _lacked_rows(length, length, n, 1, p, k - 1)
    for r, (sbp, fwd, bwd, reduce, _, full, grads, grad_sbps) in enumerate(results):
        assert halos[r] == p * ((r > 0) + (r < n - 1))  # the textbook halo: p rows from each neighbour
        assert sbp == (gt.split(2),)
        assert fwd == [("send_recv", halos[r] * row)]
        assert bwd == [("send_recv", halos[r] * row), ("send_recv", halos[r] * row)]
        assert grad_sbps == [(gt.split(2),), (gt.partial_sum,), (gt.partial_sum,)]
        assert reduce[1:] == [("all_reduce", _ring_all_reduce(w.numel(), 4, n)),
                              ("all_reduce", _ring_all_reduce(b.numel(), 4, n))]
        torch.testing.assert_close(full, F.conv1d(x, w, b, padding=p))


@given(st.sampled_from([2, 3, 4]), st.sampled_from([2, 4]), st.booleans())
def test_a_causal_conv1d_keeps_the_sequence_split(n, k, padded_first):
    """Mamba's causal depthwise conv (`conv1d(padding=k-1)[..., :L]`) and the audio models' (`F.pad(x, (k-1, 0))`
    then conv1d): the sequence stays split from input to output, values and gradients as on one device, and
    each rank receives exactly the rows it lacks: its windows' rows held by others, and the rows of its block
    of the result that the intermediate (one of length L + k - 1, split in its own blocks) left elsewhere."""
    torch.manual_seed(0)
    batch, c, length = 2, 4, 32
    x, w, b = torch.randn(batch, c, length), torch.randn(c, 1, k), torch.randn(c)

    def causal(x, w, b):
        if padded_first:
            return F.conv1d(F.pad(x, (k - 1, 0)), w, b, groups=c)
        return F.conv1d(x, w, b, padding=k - 1, groups=c)[..., :length]
    results = _run(causal, [x, w, b], (n,), [(gt.split(2),), (gt.broadcast,), (gt.broadcast,)])
    row = batch * c * 4
    long_blocks, blocks = _blocks(length + k - 1, n), _blocks(length, n)
    if padded_first:  # rows shift by k-1 into the padded tensor's blocks, whose windows then read [t, t+k-1]
        shift = [len({i + k - 1 for i in range(length)} & long_blocks[r] - {i + k - 1 for i in blocks[r]})
                 for r in range(n)]
        window = [len({t + j for t in blocks[r] for j in range(k)} & set(range(k - 1, length + k - 1)) - long_blocks[r])
                  for r in range(n)]
        want = [[("send_recv", shift[r] * row), ("send_recv", window[r] * row)] for r in range(n)]
    else:  # windows over the input for the long output's blocks, then the slice's rows to their blocks
        window = _lacked_rows(length, length + k - 1, n, 1, k - 1, k - 1)
        shift = [len(blocks[r] - long_blocks[r]) for r in range(n)]
        want = [[("send_recv", window[r] * row), ("send_recv", shift[r] * row)] for r in range(n)]
    for r, (sbp, fwd, bwd, reduce, _, full, grads, grad_sbps) in enumerate(results):
        assert sbp == (gt.split(2),) and grad_sbps[0] == (gt.split(2),)
        assert [e for e in fwd if e[1]] == [e for e in want[r] if e[1]]  # (a rank that only sends logs 0)
        assert sum(e[1] for e in fwd) < (n - 1) * length // n * row  # far less than gathering the sequence
        torch.testing.assert_close(full, causal(x, w, b))


def test_wav2vec2_feature_encoder_over_a_sequence_split_matches_one_device():
    """Hugging Face wav2vec2's convolutional feature encoder (strided convs, group norm over time, GELU) on a
    waveform split on its time dim: output and every parameter's gradient as on one device, the output
    still split on time, no fallback. Its convs move only halos (a strided window reads up to
    kernel - stride rows past its block); its group norm normalises each channel over the whole time, so
    it works on a channel split (an all-to-all there and back)."""
    transformers = pytest.importorskip("transformers")
    import copy
    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2FeatureEncoder
    cfg = transformers.Wav2Vec2Config(conv_dim=(8, 8, 8), conv_kernel=(10, 3, 3), conv_stride=(5, 2, 2),
                                      feat_extract_norm="group", conv_bias=True)
    torch.manual_seed(0)
    model = Wav2Vec2FeatureEncoder(cfg).double()
    wave = torch.randn(2, 1600, dtype=torch.float64)
    want = model(wave)
    weights = torch.randn(want.shape, dtype=torch.float64)
    (want * weights).sum().backward()
    want_grads = {n: p.grad for n, p in model.named_parameters()}

    def body():
        p = gt.placement("cpu", range(4))
        m = gt.to_global(copy.deepcopy(model), p, {"*": gt.broadcast})
        y = m(gt.to_global(wave, p, gt.split(1)))
        (y * gt.to_global(weights, p, y.sbp)).sum().backward()
        return y.sbp, y.full_tensor(), {n: q.grad.full_tensor() for n, q in m.named_parameters()}, gt.stats()
    for sbp, full, grads, stats in gt.launch(body, 4):
        assert sbp == (gt.split(2),) and not stats["fallback"]
        torch.testing.assert_close(full, want, **TOL)
        for n, g in grads.items():
            torch.testing.assert_close(g, want_grads[n], **TOL)
