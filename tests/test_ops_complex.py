"""Complex views and rotary embeddings in complex arithmetic (issue 36: Llama 4, DeepSeek-V2).

At filing time data parallelism gave an equal loss and wrong gradients: complex mul's backward is
`grad * other.conj()`, and the lazy conjugate bit `_conj` left on a shard was not honoured by the next
kernel (torch excludes the Conjugate key inside `__torch_dispatch__`). Each check below is against the
same program on one device, in complex128/float64.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, strategies as st

import globaltensor as gt

D = torch.float64
C = torch.complex128
ATOL = 1e-10


def meta_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Meta's original form (Llama 4): pairs of the last dim as complex numbers, times e^(i theta)."""
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(3)


def deepseek_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's form: the halves of the last dim interleaved into pairs before the complex view."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, h, 2, d // 2).transpose(3, 4).contiguous()
    return torch.view_as_real(torch.view_as_complex(x) * freqs_cis).flatten(3)


ROTARIES = {"meta": meta_rotary, "deepseek": deepseek_rotary}


def attention(params: dict, x: torch.Tensor, freqs: torch.Tensor, heads: int, rotary) -> torch.Tensor:
    """A tiny attention: q, k projected and rotated, softmax over keys, output projection, a loss."""
    b, s, e = x.shape
    hd = e // heads
    fc = torch.polar(torch.ones_like(freqs), freqs).view(1, s, 1, hd // 2)
    q = rotary((x @ params["wq"].t() + params["bq"]).view(b, s, heads, hd), fc)
    k = rotary((x @ params["wk"].t()).view(b, s, heads, hd), fc)
    v = (x @ params["wv"].t()).view(b, s, heads, hd)
    att = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(hd), dim=-1)
    out = torch.einsum("bhst,bthd->bshd", att, v).reshape(b, s, e) @ params["wo"].t()
    return (out * out.sin()).sum()


def _inputs(b: int, s: int, heads: int, hd: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e = heads * hd
    params = {n: torch.randn(e, e, dtype=D, generator=g) / math.sqrt(e) for n in ("wq", "wk", "wv", "wo")}
    params["bq"] = torch.randn(e, dtype=D, generator=g)
    x = torch.randn(b, s, e, dtype=D, generator=g)
    freqs = torch.randn(s, hd // 2, dtype=D, generator=g)
    return params, x, freqs


def _one_device(params: dict, x: torch.Tensor, freqs: torch.Tensor, heads: int, rotary) -> tuple:
    ps = {n: p.clone().requires_grad_() for n, p in params.items()}
    xs = x.clone().requires_grad_()
    loss = attention(ps, xs, freqs, heads, rotary)
    loss.backward()
    return loss.detach(), xs.grad, {n: p.grad for n, p in ps.items()}


def _global(params: dict, x: torch.Tensor, freqs: torch.Tensor, heads: int, rotary, world: int,
            x_sbp, param_sbps: dict) -> tuple:
    def body():
        p = gt.placement("cpu", list(range(world)))
        ps = {n: gt.to_global(t, p, param_sbps.get(n, gt.broadcast)).requires_grad_() for n, t in params.items()}
        xs = gt.to_global(x, p, x_sbp).requires_grad_()
        loss = attention(ps, xs, gt.to_global(freqs, p, gt.broadcast), heads, rotary)
        loss.backward()
        return loss.full_tensor(), xs.grad.full_tensor(), {n: t.grad.full_tensor() for n, t in ps.items()}
    gt.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = gt.launch(body, world)
    return results, gt.stats()["fallback"]


def _same(got: tuple, want: tuple) -> None:
    loss, xg, grads = got
    torch.testing.assert_close(loss, want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(xg, want[1], atol=ATOL, rtol=0)
    for n, g in want[2].items():
        torch.testing.assert_close(grads[n], g, atol=ATOL, rtol=0, msg=f"gradient of {n}")


@pytest.mark.parametrize("rotary", sorted(ROTARIES))
@pytest.mark.parametrize("world,dim", [(2, 0), (4, 0), (2, 1), (4, 1)])
def test_rotary_data_and_sequence_parallel_equal_one_device(rotary, world, dim):
    """The issue's case: parameters Broadcast, the batch (or the sequence) split; no fallback."""
    params, x, freqs = _inputs(4, 4, 2, 4)
    want = _one_device(params, x, freqs, 2, ROTARIES[rotary])
    results, fallbacks = _global(params, x, freqs, 2, ROTARIES[rotary], world, gt.split(dim), {})
    for got in results:
        _same(got, want)
    assert fallbacks == {}


@pytest.mark.parametrize("rotary", sorted(ROTARIES))
def test_rotary_head_split_equals_one_device(rotary):
    """Tensor parallel: q, k, v projections split by output rows (heads), the output projection by its
    input columns; the rotary runs on a head split."""
    params, x, freqs = _inputs(2, 3, 4, 4)
    want = _one_device(params, x, freqs, 4, ROTARIES[rotary])
    sbps = {"wq": gt.split(0), "bq": gt.split(0), "wk": gt.split(0), "wv": gt.split(0), "wo": gt.split(1)}
    results, fallbacks = _global(params, x, freqs, 4, ROTARIES[rotary], 2, gt.broadcast, sbps)
    for got in results:
        _same(got, want)
    assert fallbacks == {}


@given(b=st.integers(1, 4), s=st.integers(1, 5), heads=st.integers(1, 3), half=st.integers(1, 3),
       world=st.integers(2, 4), dim=st.integers(0, 2), rotary=st.sampled_from(sorted(ROTARIES)))
def test_rotary_shapes_ranks_and_split_dims(b, s, heads, half, world, dim, rotary):
    """Any shape (head dim even), 2-4 ranks, the batch, sequence or feature dim of x split (uneven splits
    and empty shards included): values and gradients equal one device, nothing runs replicated."""
    params, x, freqs = _inputs(b, s, heads, 2 * half, seed=b * 100 + s * 10 + heads)
    want = _one_device(params, x, freqs, heads, ROTARIES[rotary])
    results, fallbacks = _global(params, x, freqs, heads, ROTARIES[rotary], world, gt.split(dim), {})
    for got in results:
        _same(got, want)
    assert fallbacks == {}


# -- the ops one by one ----------------------------------------------------------------------------------
def _run(fn, inputs: list, sbps: list, world: int = 2):
    """fn on GlobalTensors laid out as `sbps`, then the backward of a weighted sum of its real view:
    (output full, input gradients full, output SBP) on rank 0, and the fallbacks counted."""
    def body():
        p = gt.placement("cpu", list(range(world)))
        xs = [gt.to_global(t, p, s).requires_grad_() for t, s in zip(inputs, sbps)]
        y = fn(*xs)
        real = torch.view_as_real(y) if y.is_complex() else y
        (real * torch.arange(real.numel(), dtype=D).reshape(real.shape)).sum().backward()
        return y.full_tensor(), [t.grad.full_tensor() for t in xs], y.sbp
    gt.reset_stats()
    out = gt.launch(body, world)[0]
    return out, gt.stats()["fallback"]


def _plain(fn, inputs: list):
    xs = [t.clone().requires_grad_() for t in inputs]
    y = fn(*xs)
    real = torch.view_as_real(y) if y.is_complex() else y
    (real * torch.arange(real.numel(), dtype=D).reshape(real.shape)).sum().backward()
    return y.detach(), [t.grad for t in xs]


_g = torch.Generator().manual_seed(1)
_X = torch.randn(4, 3, 2, dtype=D, generator=_g)
_Z = torch.randn(4, 3, dtype=C, generator=_g)
_W = torch.randn(4, 3, dtype=C, generator=_g)
_A = torch.randn(4, 3, dtype=D, generator=_g)
OPS = {
    "view_as_complex": (lambda x: torch.view_as_complex(x), [_X]),
    "view_as_real": (lambda z: torch.view_as_real(z), [_Z]),
    "complex_mul_both_grad": (lambda z, w: z * w, [_Z, _W]),
    "complex_square": (lambda z: z * z, [_Z]),
    "conj_then_mul": (lambda z: z.conj() * 1, [_Z]),
    "conj_imag": (lambda z: z.conj().imag * 2, [_Z]),
    "polar": (lambda r, t: torch.polar(r, t), [_A.abs(), _A * 2]),
    "complex": (lambda r, i: torch.complex(r, i), [_A, _A.exp()]),
    "flatten_of_view_as_real": (lambda z, w: torch.view_as_real(z * w).flatten(1), [_Z, _W]),
    "reshape_to_pairs": (lambda x: torch.view_as_complex(x.reshape(4, 3, 2)), [_X.reshape(4, 6)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("split", [False, True])
def test_complex_op_equals_one_device_without_fallback(name, split):
    fn, inputs = OPS[name]
    want_y, want_grads = _plain(fn, inputs)
    sbps = [gt.split(0) if split else gt.broadcast] * len(inputs)
    (y, grads, sbp), fallbacks = _run(fn, inputs, sbps)
    torch.testing.assert_close(y, want_y, atol=ATOL, rtol=0)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert fallbacks == {}
    if split:
        assert sbp == (gt.split(0),)  # computed on the shards: the split passed through


def test_complex_views_keep_splits_of_other_dims_and_partial():
    def body():
        p = gt.placement("cpu", [0, 1])
        x = gt.to_global(torch.ones(2, 3, 2, dtype=D), p, gt.split(1))
        z = torch.view_as_complex(x)
        r = torch.view_as_real(z)
        pz = torch.view_as_complex(gt.to_global(torch.ones(2, 2, dtype=D), p, gt.partial_sum))
        return z.sbp, r.sbp, pz.sbp, torch.view_as_real(pz).sbp
    z, r, pz, pr = gt.launch(body, 2)[0]
    assert z == r == (gt.split(1),)
    assert pz == pr == (gt.partial_sum,)


def test_view_as_complex_of_a_split_pair_dim_is_boxed_and_right():
    """A split of the pair dim itself cannot pass (half a pair is no complex number): the input is boxed
    first (to another dim's split or to Broadcast, whichever costs less), not run replicated."""
    x = torch.randn(3, 2, dtype=D)

    def body():
        p = gt.placement("cpu", [0, 1])
        z = torch.view_as_complex(gt.to_global(x, p, gt.split(1)))
        return z.full_tensor(), z.sbp
    gt.reset_stats()
    z, sbp = gt.launch(body, 2)[0]
    assert torch.equal(z, torch.view_as_complex(x))
    assert gt.stats()["fallback"] == {}


def test_shards_never_carry_a_lazy_conjugate_bit():
    """The cause of issue 36: conj's lazy bit on a shard is not honoured inside the dispatcher."""
    def body():
        p = gt.placement("cpu", [0, 1])
        c = gt.to_global(_Z, p, gt.split(0)).conj()
        return c._local.is_conj(), c._local.is_neg(), c.imag._local.is_neg(), (c * 1).full_tensor()
    conj, neg, imag_neg, value = gt.launch(body, 2)[0]
    assert not (conj or neg or imag_neg)
    assert torch.equal(value, _Z.conj().resolve_conj())


def test_from_local_of_a_lazy_conjugate_is_its_value():
    """`from_local(z.conj())` holds the conjugate's values, not a shard flagged conj that later kernels misread."""
    z = torch.randn(4, 3, dtype=torch.complex128)

    def program():
        p = gt.placement("cpu", [0, 1])
        x = gt.from_local(z.conj(), p, gt.broadcast)
        return (x * 1).full_tensor(), x.to_local().is_conj()

    for full, flagged in gt.launch(program, world_size=2):
        torch.testing.assert_close(full, z.conj().resolve_conj(), rtol=0, atol=0)
        assert not flagged


def test_a_write_through_a_conjugate_view_is_refused():
    """One device's `z.conj()` is a lazy view: a write through it reaches z. Here the conjugate is computed into
    the shard (a lazy bit cannot cross the dispatcher), so the write could not reach z: it raises, naming the
    view, instead of being lost (issue 34); reading the conjugate and writing into z stay as on one device."""
    z = torch.randn(4, 3, dtype=C, generator=torch.Generator().manual_seed(0))

    def body():
        g = gt.to_global(z.clone(), gt.placement("cpu", [0, 1]), gt.split(0))
        with pytest.raises(RuntimeError, match="writes into a view"):
            g.conj().mul_(2)
        with pytest.raises(RuntimeError, match="writes into a view"):
            g.conj().imag.fill_(0)
        torch.testing.assert_close(g.conj().full_tensor(), z.conj().resolve_conj())
        g.mul_(2)
        return g.full_tensor()
    for got in gt.launch(body, 2):
        torch.testing.assert_close(got, z * 2)
