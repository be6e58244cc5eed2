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

import itertools
from typing import Any, NamedTuple, Optional

import torch

from .. import boxing
from ..layout import Layout
from ..runtime import context
from ..sbp import Broadcast, Ragged, Split, Zigzag, zigzag_order_of
from .attention import current_attention_method, attention_method
from .decide import flatten_out, map_tensors
from .dispatch import run as dispatch
from .registry import aten, is_inplace
from .reading import on_reading
from .ring_attention import zigzag_ring
from .zigzag_dims import align

ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 3, 4, 5),
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, 6, 7, 8)}
SEQ = 2  # attention's q, k, v, out: [batch, heads, seq, head_dim]; its log-sum-exp [batch, heads, seq]


class ZigzagCall(NamedTuple):
    """An op called with at least one zigzag operand: what every way of running it reads
    (`plain(local, layout, shape)` builds a GlobalTensor; one with a zigzag layout comes out as `zig`)."""
    func: Any
    args: tuple
    kwargs: dict
    plain: type
    zig: type


def run(func: Any, args: tuple, kwargs: dict, plain: type, zig: type) -> Any:
    """`func` on arguments of which at least one is a zigzag tensor (`plain(local, layout, shape)`
    builds a GlobalTensor; one with a zigzag layout comes out as the zigzag class)."""
    call = ZigzagCall(func, args, kwargs, plain, zig)
    tensors: list = []
    map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    first = next(t for t in tensors if isinstance(t, zig))
    dim = _zig(first._layout)[1]
    key = _reading_of(first)
    if func in ATTENTION:
        done = _attention(call, tensors)
        if done is not None:
            return done
    elif not (is_inplace(func) and not isinstance(args[0], zig)):
        ref = next(i for i, t in enumerate(tensors) if t is first)
        alignment = align(func, args, kwargs, [tuple(t.shape) for t in tensors], ref, dim, key.pieces_for)
        if alignment is not None:
            done = _on_zigzag_reading(call, key, first._layout.placement, *alignment)
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


class Reading(NamedTuple):
    """How a zigzag reading orders a dim: in consecutive pieces (those earlier mesh axes cut, or the
    whole dim), each cut into the 2n chunks of mesh axis `axis` (of size `parts`) and read in zigzag
    order. One key serves every operand and result: a dim of the reference's `length` has its
    `pieces`; another length, where the pieces are blocks of one size, that many rows per block
    (a flattened [batch, seq] is `batch` blocks of `seq`)."""
    axis: int
    parts: int
    length: int
    pieces: tuple

    @property
    def block(self) -> Optional[int]:
        sizes = {n for _, n in self.pieces}
        return sizes.pop() if len(sizes) == 1 else None

    def pieces_for(self, length: int) -> Optional[tuple]:
        if length == self.length:
            return self.pieces
        block = self.block
        if not block or length % block:
            return None
        return tuple((i, block) for i in range(0, length, block))


def _reading_of(t: Any) -> Reading:
    axis, dim, parts = _zig(t._layout)
    return Reading(axis, parts, t.shape[dim], t._layout.zigzag_pieces(tuple(t.shape)))


def _order(length: int, key: Reading, device: Any, inverse: bool = False) -> torch.Tensor:
    order = torch.tensor(zigzag_order_of(key.pieces_for(length), key.parts), dtype=torch.long)
    return (torch.argsort(order) if inverse else order).to(device)


def _pattern(layout: Layout, dim: int, shape: tuple, key: Reading) -> Optional[Layout]:
    """`layout` with `dim` cut as the reading's zigzag: mesh axes before `key.axis` splitting it into the
    reading's pieces, `key.axis` zigzag, no other cut of it. None where no earlier axes make them."""
    pieces = key.pieces_for(shape[dim])
    if pieces is None:
        return None
    for count in range(key.axis + 1):
        for earlier in itertools.combinations(range(key.axis), count):
            plain_sbp = layout.zigzag_as_split()  # a zigzag of another dim: its contiguous split there
            sbp = [Broadcast() if a in _cuts(plain_sbp, dim) else s for a, s in enumerate(plain_sbp.sbp)]
            for b in earlier:
                sbp[b] = Split(dim)
            sbp[key.axis] = Zigzag(dim)
            target = Layout(layout.placement, tuple(sbp))
            if target.zigzag_pieces(shape) == pieces:
                return target
    return None


def _uncut(layout: Layout, dim: int) -> Layout:
    return Layout(layout.placement, tuple(Broadcast() if a in _cuts(layout, dim) else s
                                          for a, s in enumerate(layout.sbp)))


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


def _to_reading(t: Any, dim: int, key: Reading, plain: type, zig: type, placement: Any,
                take: bool = False) -> Any:
    """Operand `t` on the zigzag reading `key` of its `dim`, or None where that is not possible (another
    placement, a length the blocks do not divide); a dim of size one (broadcast) needs nothing. An
    operand holding `dim` whole is permuted locally and keeps its layout (the dispatcher then chooses,
    as for a contiguous split); with `take`, it is cut to each rank's zigzag rows instead."""
    if dim < 0 or t.ndim <= dim or t.shape[dim] == 1:
        return _box(t, t._layout.zigzag_as_split(), plain) if isinstance(t, zig) else t
    if not hasattr(t, "_layout"):  # a plain tensor counts as Broadcast (the same on every rank)
        t = plain(t, Layout(placement, (Broadcast(),) * placement.ndim), tuple(t.shape))
    length = t.shape[dim]
    if t._layout.placement != placement or key.pieces_for(length) is None:
        return None
    target = _pattern(t._layout, dim, tuple(t.shape), key)
    if isinstance(t, zig) and t._layout == target:
        return _read_as_split(t, plain)
    if isinstance(t, zig):
        t = _box(t, t._layout.zigzag_as_split(), plain)  # the contiguous split: real rows, in order
    if take and target is not None:
        return _read_as_split(_box(t, target, plain), plain)
    if _cuts(t._layout, dim):
        if target is not None:
            return _read_as_split(_box(t, target, plain), plain)
        t = _box(t, _uncut(t._layout, dim), plain)
    local = t._local.index_select(dim, _order(length, key, t._local.device)) if t._local.dim() > dim else t._local
    return plain(local, t._layout, tuple(t.shape))


def _from_reading(o: Any, dim: int, key: Reading, plain: type) -> Any:
    """A result on the zigzag reading back as the tensor it stands for: zigzag where its layout cuts
    `dim` as the reading does (else boxed so), or, holding `dim` whole, put back in order."""
    layout = o._layout
    target = _pattern(layout, dim, tuple(o.shape), key)
    cut = _cuts(layout, dim)
    if target is not None and target.zigzag_as_split() == layout:
        return plain(o._local, target, tuple(o.shape))
    if not cut:  # every rank holds the whole dim, in the reading's order: put it back
        local = o._local
        if local.dim() > dim:
            local = local.index_select(dim, _order(o.shape[dim], key, local.device, inverse=True))
        return plain(local, layout, tuple(o.shape))
    if target is not None:
        return _from_reading(_box(o, target.zigzag_as_split(), plain), dim, key, plain)
    return _from_reading(_box(o, _uncut(layout, dim), plain), dim, key, plain)


def _on_zigzag_reading(call: ZigzagCall, key: Reading, placement: Any, in_dims: list, out_dims: Any) -> Any:
    """Run an op on the zigzag reading `key`: operand i along its dim `in_dims[i]` (None: it has none),
    results read back along `out_dims(results)`; None where an operand cannot be read so."""
    func, args, kwargs, plain, zig = call
    return on_reading(func, args, kwargs, plain,
                      lambda t, i: _to_reading(t, -1 if in_dims[i] is None else in_dims[i], key, plain, zig,
                                               placement),
                      out_dims, lambda o, d: _from_reading(o, d, key, plain))


def _cut_of_seq(layout: Layout) -> tuple:
    """Which mesh axes cut the sequence, and how: q, k and v must agree for the ring's blocks."""
    return tuple((a, s) for a, s in enumerate(layout.sbp) if isinstance(s, (Split, Zigzag)) and s.dim == SEQ)


def _constant_reading(t: Any, key: Reading, plain: type) -> Any:
    """A Broadcast tensor of one value repeated (every stride 0: the gradient `out.sum()` sends) on the
    zigzag reading as a view, not a copy of this rank's rows: they are all that value. None otherwise."""
    if not hasattr(t, "_layout") or t.ndim <= SEQ or t._local.numel() == 0 or any(t._local.stride()) \
            or not all(isinstance(s, Broadcast) for s in t._layout.sbp):
        return None
    target = _pattern(t._layout, SEQ, tuple(t.shape), key)
    if target is None:
        return None
    local = target.local_shape(tuple(t.shape), context.current().rank)
    return plain(t._local.as_strided(local, (0,) * len(local)), target.zigzag_as_split(), tuple(t.shape))


def _attention(call: ZigzagCall, tensors: list) -> Any:
    """Attention on zigzag q, k, v (and in the backward grad_out, out, lse): the ring for causal, any
    method on the zigzag reading without it; None (box to contiguous) where neither is exact."""
    func, args, kwargs, plain, zig = call
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
    if not all(isinstance(t, zig) for t in qkv) or len({_cut_of_seq(t._layout) for t in qkv}) != 1:
        return None
    axis, dim, parts = _zig(q._layout)
    key = _reading_of(q)
    if dim != SEQ or any(t._layout.placement != q._layout.placement for t in main):
        return None
    # q, k, v zigzag alike; the backward's grad_out (Broadcast from out.sum(), say) is cut to the zigzag
    def read(t: Any, i: int) -> Any:
        constant = _constant_reading(t, key, plain)
        return _to_reading(t, SEQ, key, plain, zig, q._layout.placement, take=True) if constant is None else constant
    new_args, new_kwargs = map_tensors(args, kwargs, read)
    if any(t is None for t in new_args[:n_main]):
        return None
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
    return put_back([_from_reading(o, SEQ, key, plain) if isinstance(o, torch.Tensor) else o for o in outs])


__all__ = ["run"]
