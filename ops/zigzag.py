"""Ops on zigzag tensors: run on the zigzag reading where that is exact, else box to a contiguous split.

A zigzag layout (`Zigzag(d)` on mesh axis a) holds the shards that `Split(d)` holds of the tensor
with d in zigzag order. An op for which permuting d's rows permutes one dim of every operand and
result alike (`zigzag_dims.py`: pointwise ops, views that keep d one dim, transposes, matrix
products, layer norm, softmax over another dim, embeddings, the loss over rows, sums) gives the
same rows whichever order d is in, so it runs through the dispatcher on that reading: zigzag
inputs read as `Split`, the other operands put into zigzag order (a local permutation where a
rank holds the dim whole, else boxing), and the results read back as zigzag. Causal attention
depends on where each row is: it runs as the ring, told the rows' global places
(`ring_attention.zigzag_ring`), which skips the hidden blocks. Every other op (a view that merges
d with a dim before it, indexing, cumsum, random draws) gets its zigzag inputs boxed to `Split(d)`
first (one all-to-all each) and runs as usual: correct, not free. An in-place op the table does
not cover is refused on a zigzag tensor: its result would land in a copy.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import boxing
from ..layout import Layout
from ..runtime import context
from ..sbp import Broadcast, Ragged, Split, Zigzag, zigzag_order
from .attention import current_attention_method, attention_method
from .decide import flatten_out, map_tensors
from .dispatch import run as dispatch
from .registry import aten, is_inplace
from .ring_attention import zigzag_ring
from .zigzag_dims import align

ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 3, 4, 5),
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, 6, 7, 8)}
SEQ = 2  # attention's q, k, v, out: [batch, heads, seq, head_dim]; its log-sum-exp [batch, heads, seq]


def run(func: Any, args: tuple, kwargs: dict, plain: type, zig: type) -> Any:
    """`func` on arguments of which at least one is a zigzag tensor (`plain(local, layout, shape)`
    builds a GlobalTensor; one with a zigzag layout comes out as the zigzag class)."""
    tensors: list = []
    map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    first = next(t for t in tensors if isinstance(t, zig))
    axis, dim, parts = _zig(first._layout)
    if func in ATTENTION:
        done = _attention(func, args, kwargs, plain, zig, tensors)
        if done is not None:
            return done
    elif not (is_inplace(func) and not isinstance(args[0], zig)):
        ref = next(i for i, t in enumerate(tensors) if t is first)
        alignment = align(func, args, kwargs, [tuple(t.shape) for t in tensors], ref, dim)
        if alignment is not None:
            done = _on_zigzag_reading(func, args, kwargs, plain, zig, axis, parts, first, *alignment)
            if done is not None:
                return done
    if is_inplace(func) and isinstance(args[0], zig):
        raise NotImplementedError(
            f"{func}: writes a zigzag tensor ({args[0].sbp}) in place, which only pointwise ops do on the "
            f"zigzag rows; box it first: x = x.to_global(x.placement, {_split_sbp(args[0]._layout)})")
    contiguous = lambda t, i: _box(t, t._layout.zigzag_as_split(), plain) if isinstance(t, zig) else t
    new_args, new_kwargs = map_tensors(args, kwargs, contiguous)
    return dispatch(func, new_args, new_kwargs, plain)


def _zig(layout: Layout) -> tuple[int, int, int]:
    a = layout.zigzag_axes[0]
    return a, layout.sbp[a].dim, layout.placement.shape[a]


def _split_sbp(layout: Layout) -> tuple:
    return layout.zigzag_as_split().sbp


def _box(t: Any, layout: Layout, plain: type) -> Any:
    local = boxing.convert_local(t._local, t._layout, layout, tuple(t.shape), context.current())
    return plain(local, layout, tuple(t.shape))


def _read_as_split(t: Any, plain: type) -> Any:
    """The same shard read as `Split(d)` of the tensor in zigzag order (no data moves)."""
    return plain(t._local, t._layout.zigzag_as_split(), tuple(t.shape))


def _cuts(layout: Layout, dim: int) -> list[int]:
    return [a for a, s in enumerate(layout.sbp) if isinstance(s, (Split, Zigzag, Ragged)) and s.dim == dim]


def _to_reading(t: Any, axis: int, dim: int, parts: int, plain: type, zig: type, placement: Any,
                take: bool = False) -> Any:
    """Operand `t` on the zigzag reading of `dim` (mesh axis `axis`), or None where that is not possible
    (another placement); a dim of size one (broadcast) needs nothing. An operand holding `dim` whole
    is permuted locally and keeps its layout (the dispatcher then chooses, as for a contiguous split);
    with `take`, it is cut to each rank's zigzag rows instead (no permuted copy of the whole)."""
    if dim < 0 or t.ndim <= dim or t.shape[dim] == 1:
        return _box(t, t._layout.zigzag_as_split(), plain) if isinstance(t, zig) else t
    if not hasattr(t, "_layout"):  # a plain tensor counts as Broadcast (the same on every rank)
        t = plain(t, Layout(placement, (Broadcast(),) * placement.ndim), tuple(t.shape))
    if t._layout.placement != placement:
        return None
    if isinstance(t, zig) and _zig(t._layout) == (axis, dim, parts):
        return _read_as_split(t, plain)
    layout = t._layout.zigzag_as_split() if isinstance(t, zig) else t._layout
    if not take and not _cuts(layout, dim):
        if isinstance(t, zig):
            t = _box(t, layout, plain)
        order = torch.tensor(zigzag_order(t.shape[dim], parts), dtype=torch.long, device=t._local.device)
        local = t._local.index_select(dim, order) if t._local.dim() > dim else t._local
        return plain(local, layout, tuple(t.shape))
    sbp = [Broadcast() if a in _cuts(layout, dim) else s for a, s in enumerate(layout.sbp)]
    sbp[axis] = Zigzag(dim)
    target = Layout(placement, tuple(sbp))
    return _read_as_split(_box(t, target, plain), plain)


def _from_reading(o: Any, axis: int, dim: int, parts: int, plain: type) -> Any:
    """An output on the zigzag reading back as the zigzag tensor it stands for."""
    layout = o._layout
    if layout.sbp[axis] == Split(dim) and _cuts(layout, dim) == [axis]:
        return plain(o._local, Layout(layout.placement, tuple(Zigzag(dim) if a == axis else s
                                                              for a, s in enumerate(layout.sbp))), tuple(o.shape))
    if not _cuts(layout, dim):  # every rank holds the whole dim, in zigzag order: put it back
        local = o._local
        if local.dim() > dim:
            order = torch.argsort(torch.tensor(zigzag_order(o.shape[dim], parts), dtype=torch.long)).to(local.device)
            local = local.index_select(dim, order)
        return plain(local, layout, tuple(o.shape))
    sbp = [Broadcast() if a in _cuts(layout, dim) else s for a, s in enumerate(layout.sbp)]
    sbp[axis] = Split(dim)
    return _from_reading(_box(o, Layout(layout.placement, tuple(sbp)), plain), axis, dim, parts, plain)


def _on_zigzag_reading(func: Any, args: tuple, kwargs: dict, plain: type, zig: type, axis: int, parts: int,
                       first: Any, in_dims: list, out_dims: Any) -> Any:
    """Run an op on the zigzag reading: operand i along its dim `in_dims[i]` (None: it has none),
    results read back along `out_dims(results)`; None where an operand cannot be read so."""
    placement = first._layout.placement
    failed = []

    def read(t: Any, i: int) -> Any:
        r = _to_reading(t, axis, -1 if in_dims[i] is None else in_dims[i], parts, plain, zig, placement)
        if r is None:
            failed.append(t)
        return r
    new_args, new_kwargs = map_tensors(args, kwargs, read)
    if failed:
        return None
    out = dispatch(func, new_args, new_kwargs, plain)
    if is_inplace(func):  # the op wrote the shard of args[0], read as a split: the zigzag tensor is args[0]
        if new_args[0]._local is not args[0]._local:
            args[0]._local = new_args[0]._local
        return args[0]
    outs, put_back = flatten_out(out)
    dims = out_dims(outs)
    back = []
    for o, d in zip(outs, dims):
        if isinstance(o, torch.Tensor) and d is not None and d < o.ndim and o.shape[d] > 1:
            o = _from_reading(o, axis, d, parts, plain)
        back.append(o)
    return put_back(back)


def _attention(func: Any, args: tuple, kwargs: dict, plain: type, zig: type, tensors: list) -> Any:
    """Attention on zigzag q, k, v (and in the backward grad_out, out, lse): the ring for causal, any
    method on the zigzag reading without it; None (box to contiguous) where neither is exact."""
    first_qkv, drop_i, causal_i, mask_i = ATTENTION[func]
    n_main = 6 if first_qkv else 3
    main = tensors[:n_main]
    q, k = args[first_qkv], args[first_qkv + 1]
    dropout = args[drop_i] if len(args) > drop_i else kwargs.get("dropout_p", 0.0)
    causal = args[causal_i] if len(args) > causal_i else kwargs.get("is_causal", False)
    mask = args[mask_i] if len(args) > mask_i else kwargs.get("attn_mask")
    if len(tensors) != n_main or mask is not None or dropout or q.shape[SEQ] != k.shape[SEQ]:
        return None
    qkv = args[first_qkv:first_qkv + 3]
    if not all(isinstance(t, zig) for t in qkv) or len({_zig(t._layout) for t in qkv}) != 1:
        return None
    axis, dim, parts = _zig(q._layout)
    if dim != SEQ or any(t._layout.placement != q._layout.placement for t in main):
        return None
    # q, k, v zigzag; the backward's grad_out (Broadcast from out.sum(), say) is put into zigzag order
    read = lambda t, i: _to_reading(t, axis, SEQ, parts, plain, zig, q._layout.placement, take=True)
    new_args, new_kwargs = map_tensors(args, kwargs, read)
    if not causal:  # every row alike: any method, on the zigzag reading
        out = dispatch(func, new_args, new_kwargs, plain)
    elif current_attention_method() not in ("ring", "auto"):
        return None  # Ulysses or the all-gather, as forced, on the contiguous split
    else:
        with attention_method("ring"), zigzag_ring(axis) as ring:
            out = dispatch(func, new_args, new_kwargs, plain)
        if not ring.ran:
            raise NotImplementedError(f"{func}: causal attention on zigzag {main[0].sbp} runs only as the ring, "
                                      "which these layouts do not allow; box q, k, v to gt.split(2)")
    outs, put_back = flatten_out(out)
    return put_back([_from_reading(o, axis, SEQ, parts, plain) if isinstance(o, torch.Tensor) else o
                     for o in outs])


__all__ = ["run"]
