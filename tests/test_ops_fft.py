"""The fft family on global tensors (ops/fft.py): a split of a dim the transform leaves alone passes through
(each rank transforms its own lines, nothing sent), a split of a transformed dim is gathered first, a
Partial input gives a Partial output (the transforms are linear); values and gradients equal one
device's, for complex inputs too, with their conjugate bits (issue 34: `hfftn` of a Broadcast input,
`fft(z.conj())`, `ihfftn`'s `_conj_physical`)."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import mesh_placement, meshes, world_of

R, C = torch.float64, torch.complex128
TOL = dict(rtol=1e-9, atol=1e-9)

# name -> (fn(x, dims), input dtype, how many dims it transforms: 1, 2 or None for any)
FFTS = {
    "fft": (lambda x, d: torch.fft.fft(x, dim=d[0]), C, 1),
    "fft_real": (lambda x, d: torch.fft.fft(x, dim=d[0], norm="ortho"), R, 1),
    "ifft": (lambda x, d: torch.fft.ifft(x, dim=d[0]), C, 1),
    "rfft": (lambda x, d: torch.fft.rfft(x, dim=d[0]), R, 1),
    "irfft": (lambda x, d: torch.fft.irfft(x, dim=d[0], norm="forward"), C, 1),
    "hfft": (lambda x, d: torch.fft.hfft(x, dim=d[0]), C, 1),
    "ihfft": (lambda x, d: torch.fft.ihfft(x, dim=d[0]), R, 1),
    "fft2": (lambda x, d: torch.fft.fft2(x, dim=d), C, 2),
    "rfft2": (lambda x, d: torch.fft.rfft2(x, dim=d), R, 2),
    "irfft2": (lambda x, d: torch.fft.irfft2(x, dim=d), C, 2),
    "hfft2": (lambda x, d: torch.fft.hfft2(x, dim=d), C, 2),
    "ihfft2": (lambda x, d: torch.fft.ihfft2(x, dim=d), R, 2),
    "fftn": (lambda x, d: torch.fft.fftn(x, dim=d), C, None),
    "ifftn": (lambda x, d: torch.fft.ifftn(x, dim=d, norm="ortho"), C, None),
    "rfftn": (lambda x, d: torch.fft.rfftn(x, dim=d), R, None),
    "irfftn": (lambda x, d: torch.fft.irfftn(x, dim=d), C, None),
    "hfftn": (lambda x, d: torch.fft.hfftn(x, dim=d), C, None),
    "ihfftn": (lambda x, d: torch.fft.ihfftn(x, dim=d), R, None),
}
FFT_ATEN = {"_fft_r2c", "_fft_c2c", "_fft_c2r", "_conj_physical", "_conj"}


def _loss_weights(y: torch.Tensor) -> torch.Tensor:
    real = torch.view_as_real(y) if y.is_complex() else y
    return torch.linspace(-1, 1, real.numel(), dtype=real.dtype).reshape(real.shape)


def _plain(fn, x: torch.Tensor):
    x = x.clone().requires_grad_()
    y = fn(x).resolve_conj()  # ihfft's output is a lazy conjugate on one device
    real = torch.view_as_real(y) if y.is_complex() else y
    (real * _loss_weights(y)).sum().backward()
    return y.detach(), x.grad


def _global(fn, x: torch.Tensor, mesh, sbp: tuple):
    """fn on x laid out as `sbp` on every rank of `mesh`'s world: (output full, input gradient full, output
    SBP, what the forward sent) per rank."""
    def body():
        p = mesh_placement(mesh)
        gx = gt.to_global(x, p, sbp).requires_grad_()
        with gt.comm_log() as log:
            y = fn(gx)
        sent = [(e.kind, e.recv_bytes) for e in log.events]
        real = torch.view_as_real(y) if y.is_complex() else y
        (real * _loss_weights(y)).sum().backward()
        inside = gt.rank() in p.flat_ranks
        # the wrapper carries the conjugate/negative bits exactly as its shard: neither (ops/complex.py)
        bits = {(y.is_conj(), y.is_neg()), (y._local.is_conj(), y._local.is_neg()),
                (gx.grad._local.is_conj(), gx.grad._local.is_neg())}
        assert bits == {(False, False)}, bits
        return y.full_tensor(), gx.grad.full_tensor(), y.sbp, sent, inside
    gt.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gt.launch(body, world_of(mesh))


def _fallen() -> set:
    return {k.removeprefix("aten.").split(".")[0] for k in gt.stats()["fallback"]} & FFT_ATEN


def _input(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, dtype=dtype, generator=g)


@given(meshes([(2,), (3,), (4,), (2, 2)]), st.sampled_from(sorted(FFTS)),
       st.lists(st.integers(1, 5), min_size=2, max_size=3), st.data())
def test_fft_any_split_equals_one_device(mesh, name, shape, data):
    """Any transform, any dims, any layout (splits of transformed or untouched dims, uneven and empty
    shards, Partial, a world larger than the mesh): values and gradients equal one device's, and no fft
    runs replicated."""
    fn, dtype, count = FFTS[name]
    n = len(shape)
    k = count or data.draw(st.integers(1, n))
    dims = tuple(data.draw(st.permutations(range(n)))[:k])
    for d in dims:
        shape[d] = max(shape[d], 2)  # a transform of one point is defined, of the c2r kind not
    x = _input(tuple(shape), dtype, seed=sum(shape))
    sbp = tuple(data.draw(st.sampled_from([gt.broadcast, gt.partial_sum] + [gt.split(d) for d in range(n)]))
                for _ in mesh)
    f = lambda t: fn(t, dims)  # noqa: E731
    want_y, want_g = _plain(f, x)
    for y, g, _, _, inside in _global(f, x, mesh, sbp):
        if inside:
            torch.testing.assert_close(y, want_y, **TOL)
            torch.testing.assert_close(g, want_g, **TOL)
    assert not _fallen(), gt.stats()["fallback"]


@pytest.mark.parametrize("name", sorted(FFTS))
def test_split_of_an_untouched_dim_stays_and_sends_nothing(name):
    """The lines along the transformed dims are whole on every rank: the split passes, nothing is sent."""
    fn, dtype, count = FFTS[name]
    x = _input((5, 4, 6), dtype, seed=1)
    dims = (1, 2)[:count] if count else (1, 2)
    f = lambda t: fn(t, dims)  # noqa: E731
    want_y, want_g = _plain(f, x)
    for y, g, sbp, sent, _ in _global(f, x, (4,), (gt.split(0),)):
        torch.testing.assert_close(y, want_y, **TOL)
        torch.testing.assert_close(g, want_g, **TOL)
        assert sbp == (gt.split(0),)
        assert sent == []
    assert not _fallen()


@pytest.mark.parametrize("name", ["fft", "irfft", "fftn", "hfftn", "ifftn"])
def test_partial_input_gives_partial_output(name):
    """The transforms are linear: a Partial input is transformed term by term, no reduction in the call.
    (Not rfft/ihfft: their output, complex, is larger than their real input, so reducing the input first
    costs less and the dispatcher rightly does that.)"""
    fn, dtype, count = FFTS[name]
    x = _input((3, 4), dtype, seed=2)
    dims = (1,) if count == 1 else (0, 1)
    f = lambda t: fn(t, dims)  # noqa: E731
    want_y, _ = _plain(f, x)
    for y, _, sbp, sent, _ in _global(f, x, (2,), (gt.partial_sum,)):
        torch.testing.assert_close(y, want_y, **TOL)
        assert sbp == (gt.partial_sum,) and sent == []


@pytest.mark.parametrize("world", [1, 2, 4])
def test_hfftn_of_a_broadcast_input_equals_one_device(world):
    """Issue 34's case: hfftn (which conjugates its input on the way) of a Broadcast complex tensor."""
    z = _input((3, 4, 5), C, seed=3)
    want_y, want_g = _plain(torch.fft.hfftn, z)
    for y, g, _, _, _ in _global(torch.fft.hfftn, z, (world,), (gt.broadcast,)):
        torch.testing.assert_close(y, want_y, **TOL)
        torch.testing.assert_close(g, want_g, **TOL)
    assert not _fallen()


CONJ = {
    "fft_of_conj": lambda z: torch.fft.fft(z.conj(), dim=1),
    "conj_of_fft_times_one": lambda z: torch.fft.fft(z, dim=1).conj() * 1,
    "imag_of_conj_fft": lambda z: torch.fft.ifft(z, dim=1).conj().imag,
    "resolve_conj": lambda z: torch.fft.fft(z.conj().resolve_conj(), dim=1),
    "conj_physical": lambda z: torch.conj_physical(torch.fft.fft(z, dim=1)),
    "polar_angle": lambda z: torch.polar(z.abs(), torch.fft.fft(z, dim=1).angle()),
    "view_as_real_of_fft": lambda z: torch.view_as_real(torch.fft.fft(z, dim=1)) * 2,
}


@pytest.mark.parametrize("name", sorted(CONJ))
@pytest.mark.parametrize("sbp", [gt.broadcast, gt.split(0), gt.split(1)])
def test_conjugate_bits_through_ffts(name, sbp):
    """Conjugates (lazy on one device, computed into the shard here) meet ffts: values and gradients equal."""
    z = _input((4, 5), C, seed=4)
    want_y, want_g = _plain(CONJ[name], z)
    for y, g, _, _, _ in _global(CONJ[name], z, (2,), (sbp,)):
        torch.testing.assert_close(y, want_y, **TOL)
        torch.testing.assert_close(g, want_g, **TOL)
    assert not _fallen()
