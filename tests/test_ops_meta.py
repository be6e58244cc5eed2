"""Rules' meta stand-ins (`Rule.meta`) against torch's own kernels.

The dispatcher infers output shapes and dtypes on a cache miss with a rule's
`meta` where it has one (torch's meta kernels for elementwise ops are Python
references, ~0.1 ms a call). The property, against the real kernel on
zeros and torch's meta kernel on the same shapes and dtypes:

- sound: an output the stand-in gives is torch's meta kernel's, which the
  dispatcher would otherwise use (torch's meta and kernel can differ: a
  kernel may lack a dtype its meta accepts, and pow(bool, True) is int64 on
  meta but bool on CPU; the wrapper follows the real shard's dtype);
- complete: where both give the same output, the stand-in gives it too,
  except for a matrix product of mixed dtypes. torch is not consistent there
  (mm's meta kernel accepts it, bmm's does not; an empty product returns
  either dtype), so the stand-in raises, and a raise sends the dispatcher to
  its replicated fallback, which runs the real kernel: its output, or its
  error, is the user's.
"""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from globaltensor.ops.matrix import product_meta
from globaltensor.ops.registry import RULES

aten = torch.ops.aten
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool]


def _outcome(fn):
    try:
        out = fn()
    except Exception:
        return "error"
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple((tuple(o.shape), o.dtype) for o in outs)


def _on(device, a):
    if isinstance(a, torch.Tensor):
        return torch.zeros(a.shape, dtype=a.dtype, device=device) if a.dtype != torch.bool else \
            torch.zeros(a.shape, device=device).bool()
    return a


def _agree(func, args, kwargs=None, complete=True):
    """args hold meta tensors; the real kernel runs on zeros of the same shapes and dtypes."""
    kwargs = kwargs or {}
    meta = RULES[func].meta
    assert meta is not None, f"{func} has no meta stand-in"
    real = _outcome(lambda: func(*[_on("cpu", a) for a in args], **{k: _on("cpu", v) for k, v in kwargs.items()}))
    torch_meta = _outcome(lambda: func(*args, **kwargs))
    got = _outcome(lambda: meta(func, args, kwargs))
    what = f"{func} on {[getattr(a, 'shape', a) for a in args]} {kwargs}"
    if got != "error":
        assert got == torch_meta, f"{what}: stand-in {got}, torch's meta {torch_meta} (kernel {real})"
    elif complete:
        assert real == "error" or real != torch_meta, f"{what}: stand-in raises, torch gives {real}"


@st.composite
def shape_pairs(draw):
    """Two shapes that usually broadcast (size-1 and absent dims, size 0) and sometimes do not."""
    out = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    def variant():
        dims = [draw(st.sampled_from([n, 1, n, draw(st.integers(0, 4))])) for n in out]
        return tuple(dims[draw(st.integers(0, len(dims))):])
    return variant(), variant()


def meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.eq.Tensor, aten.lt.Tensor,
          aten.maximum.default, aten.atan2.default, aten.add_.Tensor, aten.mul_.Tensor, aten.copy_.default,
          aten.bitwise_and.Tensor, aten.logical_or.default, aten.pow.Tensor_Tensor]
UNARY = [aten.relu.default, aten.sigmoid.default, aten.exp.default, aten.abs.default, aten.neg.default,
         aten.isnan.default, aten.logical_not.default, aten.sqrt.default, aten.clone.default, aten.detach.default]
WITH_SCALAR = [aten.add.Scalar, aten.mul.Scalar, aten.pow.Tensor_Scalar, aten.div.Scalar, aten.eq.Scalar,
               aten.clamp_min.default, aten.fill_.Scalar, aten.masked_fill.Scalar, aten.rsub.Scalar]


@given(st.sampled_from(BINARY), shape_pairs(), st.sampled_from(DTYPES), st.sampled_from(DTYPES))
def test_binary_elementwise_matches_torch(func, shapes, da, db):
    _agree(func, (meta(shapes[0], da), meta(shapes[1], db)))


@given(st.sampled_from(UNARY), shape_pairs(), st.sampled_from(DTYPES))
def test_unary_elementwise_matches_torch(func, shapes, dtype):
    _agree(func, (meta(shapes[0], dtype),))


@given(st.sampled_from(WITH_SCALAR), shape_pairs(), st.sampled_from(DTYPES),
       st.sampled_from([2, 2.5, True, 0, -1.0]))
def test_scalar_elementwise_matches_torch(func, shapes, dtype, scalar):
    if func is aten.masked_fill.Scalar:
        _agree(func, (meta(shapes[0], dtype), meta(shapes[1], torch.bool), scalar))
    else:
        _agree(func, (meta(shapes[0], dtype), scalar))


@given(shape_pairs(), shape_pairs(), st.sampled_from(DTYPES), st.sampled_from(DTYPES))
def test_ternary_and_keyword_elementwise_match_torch(s1, s2, da, db):
    _agree(aten.where.self, (meta(s1[0], torch.bool), meta(s1[1], da), meta(s2[0], db)))
    _agree(aten.addcmul.default, (meta(s1[0], da), meta(s1[1], da), meta(s2[1], db)), {"value": 0.5})
    _agree(aten.lerp.Scalar, (meta(s1[0], da), meta(s2[0], db), 0.3))
    _agree(aten._to_copy.default, (meta(s1[0], da),), {"dtype": db})
    _agree(aten.clamp.Tensor, (meta(s1[0], da),), {"min": meta(s2[0], db)})


@given(st.sampled_from([aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default]),
       st.lists(st.integers(0, 4), min_size=4, max_size=4), st.integers(0, 5),
       st.sampled_from([torch.float32, torch.float64, torch.int64]), st.data())
def test_product_meta_matches_torch(func, dims, wrong, dtype, data):
    """Fitting operands, or (wrong != 0) one mismatch: a contracted size, a batch, a rank, a dtype, a bias."""
    b, m, k, n = dims
    batched = func in (aten.bmm.default, aten.baddbmm.default)
    lead = (b,) if batched else ()
    a_shape, b_shape = lead + (m, k), lead + (k, n)
    b_dtype = dtype
    if wrong == 1:
        b_shape = lead + (k + 1, n)
    elif wrong == 2 and batched:
        b_shape = (b + 1, k, n)
    elif wrong == 3:
        a_shape = (m, k, 1, 1)[:len(a_shape) + 1]
    elif wrong == 4:
        b_dtype = torch.float16 if dtype != torch.float16 else torch.float32
    args = [meta(a_shape, dtype), meta(b_shape, b_dtype)]
    if func in (aten.addmm.default, aten.baddbmm.default):
        out = lead + (m, n)
        bias = data.draw(st.sampled_from([out, out[-1:], (1,) * len(out), (), out[:-1] + (n + 1,)]))
        args.insert(0, meta(bias, dtype))
    assert product_meta is RULES[func].meta
    _agree(func, tuple(args), complete=b_dtype == dtype)
