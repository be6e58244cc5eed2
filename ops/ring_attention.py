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

Zigzag (`gt.zigzag(2)`, `ops/zigzag.py`): the ring runs on the zigzag reading
(each rank's rows as a `Split`), and `zigzag_ring` tells it where the rows
really are: rank i of n holds chunks i and 2n-1-i of 2n. A block is then
seen whole, not at all, or (its own) with the causal mask, chunk by chunk:
from a member j < i the query rows see key chunk j only, from j > i only the
late query chunk sees both key chunks, so every step costs half a block
square on every rank, and the diagonal step two chunk triangles; causal work
is balanced where a contiguous split gives the last rank (2n-1)/n of the mean.
"""
from __future__ import annotations

import itertools
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from ..layout import Layout
from ..runtime import context
from ..sbp import Split, Zigzag
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


class _ZigzagRing(threading.local):
    axis: Optional[int] = None  # the mesh axis whose Split(2) is a zigzag read in zigzag order
    run: Optional["ZigzagRun"] = None


_zigzag = _ZigzagRing()


@dataclass
class ZigzagRun:
    ran: bool = False


@contextmanager
def zigzag_ring(axis: int) -> Iterator[ZigzagRun]:
    """While open, a ring over `axis` places its rows as `Zigzag(2)` on that axis (the inputs are
    zigzag tensors read as `Split(2)`); the result's `.ran` says whether the ring ran (the caller
    refuses a result computed any other way, which would take the zigzag order for the real one)."""
    run = ZigzagRun()
    previous = (_zigzag.axis, _zigzag.run)
    _zigzag.axis, _zigzag.run = axis, run
    try:
        yield run
    finally:
        _zigzag.axis, _zigzag.run = previous


def _rows(layout: Layout, shape: tuple, rank: int) -> tuple[tuple[int, int], ...]:
    """The global (start, size) ranges of the sequence rows `rank` holds under `layout`, in local order."""
    axis = _zigzag.axis
    if axis is not None:
        if axis not in ring_axes(layout):
            raise AssertionError(f"ring attention: zigzag rows on mesh axis {axis}, but the ring runs over "
                                 f"{ring_axes(layout)}")
        _zigzag.run.ran = True
        layout = Layout(layout.placement, tuple(Zigzag(SEQ) if a == axis else s for a, s in enumerate(layout.sbp)))
    return layout.ranges(shape, rank)[SEQ]


Block = tuple[tuple[int, int], tuple[int, int], bool]  # (query rows, key rows) as local (start, size), causal


def _blocks(q_rows: tuple, k_rows: tuple, causal: bool) -> list[Block]:
    """The kernel calls that attend query rows `q_rows` to key rows `k_rows` (global ranges in local
    order): one call on the whole blocks where it can, the causal mask only on a block's own rows.

    Causal: a key chunk is wholly before a query chunk (seen), wholly after (hidden) or the same rows
    (the diagonal). On the same rows the local order is the global one and both split alike, so one
    call with the kernel's mask is exact; else the seen pairs are, for a contiguous or zigzag split,
    a rectangle of chunks, one call (any other pattern: a call per seen pair).
    """
    q_n, k_n = sum(n for _, n in q_rows), sum(n for _, n in k_rows)
    if q_n == 0 or k_n == 0:
        return []
    if not causal:
        return [((0, q_n), (0, k_n), False)]
    if q_rows == k_rows:
        return [((0, q_n), (0, k_n), True)]
    seen = []
    q_off = 0
    for qa, qn in q_rows:
        k_off = 0
        for ka, kn in k_rows:
            if qn and kn and ka + kn - 1 <= qa:
                seen.append(((q_off, qn), (k_off, kn)))
            elif qn and kn and ka <= qa + qn - 1:
                raise AssertionError(f"ring attention: query rows {q_rows} and key rows {k_rows} overlap unaligned")
            k_off += kn
        q_off += qn
    qs = sorted({q for q, _ in seen})
    ks = sorted({k for _, k in seen})
    if len(seen) == len(qs) * len(ks) and _adjacent(qs) and _adjacent(ks):
        return [((qs[0][0], sum(n for _, n in qs)), (ks[0][0], sum(n for _, n in ks)), False)] if seen else []
    return [(q, k, False) for q, k in seen]


def _adjacent(pieces: list) -> bool:
    return all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def _rows_of(t: torch.Tensor, piece: tuple[int, int]) -> torch.Tensor:
    start, n = piece
    return t if (start, n) == (0, t.shape[SEQ]) else t.narrow(SEQ, start, n)


def _attend(func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Any) -> tuple:
    """One block of the forward kernel (the name the tests count calls and rows by)."""
    return func(q, k, v, 0.0, causal, scale=scale)


def _attend_backward(func: Any, grad_out, q, k, v, out, lse, causal: bool, scale: Any) -> tuple:
    """One block of the backward kernel."""
    return func(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


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
    k_layout, v_layout = where.in_layouts[1], where.in_layouts[2]
    q_rows = _rows(where.in_layouts[0], where.ctx.shapes[0], where.rank)
    out = lse = None
    held = {"k": k, "v": v}
    for step in range(len(ring.members)):
        arriving = None
        if step < len(ring.members) - 1:  # the next block travels while this one is computed
            source = ring.holder(step + 1)
            arriving = _pass_on(comm, ring, held, {
                "k": _block_shape(k, k_layout, where.ctx.shapes[1], source),
                "v": _block_shape(v, v_layout, where.ctx.shapes[2], source)}, k.dtype, step)
        k_rows = _rows(k_layout, where.ctx.shapes[1], ring.holder(step))
        # an empty shard (uneven heads or batch) attends nothing: the CPU kernels divide by its size
        blocks = _blocks(q_rows, k_rows, causal) if q.numel() and held["k"].numel() else []
        for q_piece, k_piece, masked in blocks:
            o, l = _attend(func, _rows_of(q, q_piece), _rows_of(held["k"], k_piece), _rows_of(held["v"], k_piece),
                           masked, scale)
            if out is None and q_piece == (0, q.shape[SEQ]):
                out, lse = o.to(l.dtype), l
                continue
            if out is None:  # rows no block has reached yet: nothing seen (zero weight, log-sum-exp -inf)
                out = q.new_zeros(q.shape[:-1] + v.shape[-1:], dtype=l.dtype)
                lse = torch.full(q.shape[:-1], -torch.inf, dtype=l.dtype, device=q.device)
            rows = slice(q_piece[0], q_piece[0] + q_piece[1])
            _, lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], o, l)
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
    q_rows = _rows(where.in_layouts[1], where.ctx.shapes[1], where.rank)
    if n == 1:  # nothing travels: one block, or zeros for an empty one (the kernel divides by its size)
        if q.numel() and k.numel():
            return func(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
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
        k_rows = _rows(k_layout, where.ctx.shapes[2], owner)
        dk = dv = None
        blocks = _blocks(q_rows, k_rows, causal) if q.numel() and held["k"].numel() else []
        for q_piece, k_piece, masked in blocks:
            pq = lambda t: _rows_of(t, q_piece)
            pk = lambda t: _rows_of(t, k_piece)
            dq_, dk_, dv_ = _attend_backward(func, pq(grad_out), pq(q), pk(held["k"]), pk(held["v"]), pq(out),
                                             pq(lse), masked, scale)
            if grad_q is None and q_piece == (0, q.shape[SEQ]):
                grad_q = dq_
            else:
                if grad_q is None:
                    grad_q = torch.zeros_like(q)
                pq(grad_q).add_(dq_)
            if k_piece == (0, held["k"].shape[SEQ]) and dk is None:
                dk, dv = dk_, dv_
            else:
                if dk is None:
                    dk, dv = torch.zeros_like(held["k"]), torch.zeros_like(held["v"])
                pk(dk).add_(dk_)
                pk(dv).add_(dv_)
            del dq_, dk_, dv_
        if dk is None:
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
