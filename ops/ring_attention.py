"""Ring attention: each rank keeps its query block while key/value blocks travel around a ring.

Liu et al.'s blockwise attention over a sequence split: with n ranks on the
ring, rank p holds query block p and, at step s, the key/value block of
member p - s; the next block is already on its way (an asynchronous
point-to-point exchange) while this one is computed with torch's CPU flash
kernel. Partial results merge by their log-sum-exp (the online softmax), so
no rank ever holds more than two key/value blocks. Causal: the global offsets
of the blocks say whether a block is wholly visible, wholly hidden (skipped)
or the diagonal one (the kernel's own causal mask, as q and k share the
split). The backward passes the key/value blocks around again with their
gradient accumulators, which end on their owner after n hops; every block's
contribution uses the saved global output and log-sum-exp, as the flash
backward does for its own tiles.

The ring of a rank is every rank of the placement that differs from it only
on the mesh axes that split the keys' sequence, in mesh order, which is the
order of their blocks (mesh axis 0 cuts first).
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..layout import Layout
from ..runtime import context
from ..sbp import Split
from .registry import Local

SEQ = 2  # q, k, v are [batch, heads, seq, head_dim]


@dataclass(frozen=True)
class Ring:
    """Where a rank sits on its ring: the members (global ranks, in block order) and its position."""
    members: tuple[int, ...]
    position: int

    @property
    def next(self) -> int:
        return self.members[(self.position + 1) % len(self.members)]

    @property
    def prev(self) -> int:
        return self.members[(self.position - 1) % len(self.members)]

    def holder(self, step: int) -> int:
        """Whose key/value block this rank works on at `step` (its own at step 0)."""
        return self.members[(self.position - step) % len(self.members)]


def ring_axes(layout: Layout) -> tuple[int, ...]:
    """The mesh axes that split the sequence of a key laid out as `layout`."""
    return tuple(a for a, s in enumerate(layout.sbp) if s == Split(SEQ))


def ring_of(layout: Layout, rank: int) -> Ring:
    placement = layout.placement
    axes = ring_axes(layout)
    coord = list(placement.coord(rank))
    members = []
    for sub in itertools.product(*[range(placement.shape[a]) for a in axes]):
        for a, c in zip(axes, sub):
            coord[a] = c
        members.append(placement.rank_at(coord))
    return Ring(tuple(members), members.index(rank))


def ring_recv_bytes(k_layout: Layout, v_layout: Layout, k_shape: tuple, v_shape: tuple, itemsize: int,
                    backward: bool) -> tuple[int, ...]:
    """Bytes each global rank receives running the ring: the other members' key and value blocks,
    and in the backward also every member's key and value gradient blocks (their accumulators)."""
    placement = k_layout.placement
    out = [0] * (max(placement.flat_ranks) + 1)
    for r in placement.flat_ranks:
        ring = ring_of(k_layout, r)
        for m in ring.members:
            block = _numel(k_layout.local_shape(k_shape, m)) + _numel(v_layout.local_shape(v_shape, m))
            out[r] += block * itemsize * ((m != r) + backward)
    return tuple(out)


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _key(*what: Any) -> int:
    """A message key the same in every process (str hashes are not), distinct per step and tensor."""
    return zlib.crc32(repr(("ring attention",) + what).encode()) or 1


def _visibility(q_box: tuple, k_box: tuple, causal: bool) -> str:
    """What query rows see of key rows, each a (global start, size) box: "full", "none" or "diagonal"
    (causal: row i sees key j <= i; q and k share the split, so only a block's own keys are partial)."""
    (qa, qn), (ka, kn) = q_box, k_box
    if qn == 0 or kn == 0:
        return "none"
    if not causal or ka + kn - 1 <= qa:
        return "full"
    if ka > qa + qn - 1:
        return "none"
    if (qa, qn) == (ka, kn):
        return "diagonal"
    raise AssertionError(f"ring attention: query rows {q_box} and key rows {k_box} overlap unaligned")


def _pass_on(comm: Any, ring: Ring, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple],
             dtype: torch.dtype, step: Any) -> Callable[[], dict[str, torch.Tensor]]:
    """Send `tensors` to the next member and receive tensors of `shapes` from the previous one; the
    result waits for both."""
    names = sorted(set(tensors) | set(shapes))
    finishes = {name: comm.send_recv_start({ring.next: tensors[name]} if name in tensors else {},
                                           {ring.prev: (shapes[name], dtype)} if name in shapes else {},
                                           key=_key(name, step))
                for name in names}
    return lambda: {name: f().get(ring.prev) for name, f in finishes.items()}


def _block_shape(t: torch.Tensor, layout: Layout, shape: tuple, rank: int) -> tuple:
    return tuple(t.shape[:SEQ]) + (layout.local_shape(shape, rank)[SEQ],) + tuple(t.shape[SEQ + 1:])


def ring_forward(func: Any, args: tuple, kwargs: dict, where: Local) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = args[:3]
    causal = bool(where.ctx.arg(4, "is_causal", False))
    scale = kwargs.get("scale")
    if where.checking:
        return func(q, k, v, 0.0, causal, scale=scale)
    comm, ring = context.current(), ring_of(where.in_layouts[1], where.rank)
    q_box = where.in_box(0)[SEQ]
    k_layout, v_layout = where.in_layouts[1], where.in_layouts[2]
    out = lse = None
    held = {"k": k, "v": v}
    for step in range(len(ring.members)):
        arriving = None
        if step < len(ring.members) - 1:  # the next block travels while this one is computed
            source = ring.holder(step + 1)
            arriving = _pass_on(comm, ring, held, {
                "k": _block_shape(k, k_layout, where.ctx.shapes[1], source),
                "v": _block_shape(v, v_layout, where.ctx.shapes[2], source)}, k.dtype, step)
        k_box = k_layout.shard(where.ctx.shapes[1], ring.holder(step))[SEQ]
        seen = _visibility(q_box, k_box, causal)
        if seen != "none" and q.numel() and held["k"].numel():
            o, l = func(q, held["k"], held["v"], 0.0, seen == "diagonal", scale=scale)
            out, lse = (o.to(l.dtype), l) if out is None else _merge(out, lse, o, l)
        if arriving is not None:
            held = arriving()
    if out is None:  # no keys seen (an empty shard): what the kernel gives for empty inputs
        return (q.new_zeros(q.shape[:-1] + v.shape[-1:]),
                q.new_zeros(q.shape[:-1], dtype=torch.float32 if q.dtype in (torch.half, torch.bfloat16) else q.dtype))
    return out.to(q.dtype), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> tuple:
    """Two softmax-normalised partial results as one (each weighed by its share of the normaliser)."""
    new = torch.logaddexp(lse, l)
    out.mul_((lse - new).exp_().unsqueeze(-1))  # in place: the ring's memory is a few blocks, not n
    return out.add_(o.to(out.dtype).mul_((l - new).exp_().unsqueeze(-1))), new


def ring_backward(func: Any, args: tuple, kwargs: dict, where: Local) -> tuple:
    grad_out, q, k, v, out, lse = args[:6]
    causal = bool(where.ctx.arg(7, "is_causal", False))
    scale = kwargs.get("scale")
    if where.checking:
        return func(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    comm, ring = context.current(), ring_of(where.in_layouts[2], where.rank)
    n = len(ring.members)
    if n == 1:  # nothing travels: one block, or zeros for an empty one (the kernel divides by its size)
        if q.numel() and k.numel():
            return func(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q_box = where.in_box(1)[SEQ]
    k_layout, v_layout = where.in_layouts[2], where.in_layouts[3]
    grad_q = None
    held = {"k": k, "v": v}
    sent = None  # the accumulator passed on last step
    for step in range(n):
        owner = ring.holder(step)
        arriving = None
        if step < n - 1:
            source = ring.holder(step + 1)
            arriving = _pass_on(comm, ring, held, {
                "k": _block_shape(k, k_layout, where.ctx.shapes[2], source),
                "v": _block_shape(v, v_layout, where.ctx.shapes[3], source)}, k.dtype, ("kv", step))
        # the accumulator of the block held now comes from the previous member, which finished with it
        incoming = None if step == 0 else _receive(comm, ring, {
            "dk": _block_shape(k, k_layout, where.ctx.shapes[2], owner),
            "dv": _block_shape(v, v_layout, where.ctx.shapes[3], owner)}, k.dtype, ("grad", step))
        if sent is not None:  # its receiver has posted the receive (above): freed before the kernel's peak
            sent()
        k_box = k_layout.shard(where.ctx.shapes[2], owner)[SEQ]
        seen = _visibility(q_box, k_box, causal)
        if seen != "none" and q.numel() and held["k"].numel():
            dq, dk, dv = func(grad_out, q, held["k"], held["v"], out, lse, 0.0, seen == "diagonal", scale=scale)
            grad_q = dq if grad_q is None else grad_q.add_(dq)
            del dq
        else:
            dk, dv = torch.zeros_like(held["k"]), torch.zeros_like(held["v"])
        if incoming is not None:
            acc = incoming()
            dk, dv = acc["dk"].add_(dk), acc["dv"].add_(dv)
        # after n - 1 hops the accumulator's next member is its owner
        sent = _pass_on(comm, ring, {"dk": dk, "dv": dv}, {}, k.dtype, ("grad", step + 1))
        del dk, dv
        if arriving is not None:
            held = arriving()
    mine = _receive(comm, ring, {"dk": tuple(k.shape), "dv": tuple(v.shape)}, k.dtype, ("grad", n))()
    sent()
    return torch.zeros_like(q) if grad_q is None else grad_q, mine["dk"], mine["dv"]


def _receive(comm: Any, ring: Ring, shapes: dict[str, tuple], dtype: torch.dtype,
             step: Any) -> Callable[[], dict[str, torch.Tensor]]:
    return _pass_on(comm, ring, {}, shapes, dtype, step)
