"""Ring attention: each rank keeps its query block while key/value blocks travel around a ring.

Liu et al.'s blockwise attention over a sequence split: with n ranks on the
ring, rank p holds query block p and, at step s, the key/value block of
member p - s; the next one is already on its way (an asynchronous
point-to-point exchange) while this one is computed with torch's CPU flash
kernel. Partial results merge by their log-sum-exp (the online softmax).
Blocks travel in pieces, piece j of every block going round the ring before
piece j + 1 leaves its owner, so a rank holds one piece in hand and one
arriving, never a foreign block: the ring's memory beyond its own blocks and
results is a few pieces (`PIECES`, `pieces_of`), which is what puts its
peak at one process's / n. Causal: the global rows of the query block and a
key piece say which keys each query row sees (`_blocks`): all of them, none
(skipped), or, on rows both share, the kernel's own causal mask. The
backward passes the key/value pieces around again with their gradient
accumulators, which end on their owner after n hops, and cuts the queries
into pieces too; every piece's contribution uses the saved global output and
log-sum-exp, as the flash backward does for its own tiles.

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
Blockwise, a piece is the same share of both chunks (`_range_cuts`), so each
piece's step is balanced too: the ring moves at the pace of its slowest rank
step by step, not on the whole.
"""
from __future__ import annotations

import itertools
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from ..layout import Layout
from ..runtime import context
from ..sbp import Split, Zigzag
from .registry import ShardSite

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

# Blockwise within a ring step, as Liu et al.'s ring attention computes each hop: a rank's key/value
# block travels, and is attended, in pieces, piece j of every block going once round the ring before
# piece j + 1 sets off, so a rank holds one piece in hand and one arriving (and in the backward their
# gradient accumulators), never a whole foreign block; the backward also cuts the queries into pieces,
# so the kernel's gradient temporaries are a piece's too. The bytes are the whole blocks' either way.
PIECES = 16          # at most this many key/value pieces a block in the backward (its extra memory: ~14 pieces)
QUERY_PIECES = 4     # at most this many query pieces in the backward (the kernel's query-sized temporaries)
FORWARD_PIECES = 4   # at most this many pieces a block in the forward, whose peak is below the backward's
MIN_PIECE_ROWS = 512  # and no kernel call under this many rows: a short sequence keeps a few large calls
# (a zigzag block's pieces are two ranges each: at 256 rows per call its 16k causal ring took 1.38x one
# process / 2 on 2 processes, at 512 (8 pieces) 1.14x; the contiguous ring keeps 16 pieces of 512 rows there)


def pieces_of(rows: int, most: int) -> int:
    """How many pieces a block of `rows` sequence rows is cut into, at most `most` (measured: CPU flash
    calls of 256 rows and more cost what one whole call does, 128 about 10% more). Each piece costs a
    pass over the whole query block (the forward merges its output in, the backward adds its query
    gradient), so the counts are as small as the memory target allows."""
    return max(1, min(most, rows // max(1, MIN_PIECE_ROWS)))


def _cuts(rows: int, count: int) -> list[tuple[int, int]]:
    """`rows` local rows as `count` balanced (start, size) pieces."""
    bounds = [rows * j // count for j in range(count + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _range_cuts(sizes: list[int], count: int) -> list[tuple[tuple[int, int], ...]]:
    """Local rows held as consecutive ranges of `sizes` as `count` pieces, piece j the j-th of `count`
    balanced cuts of every range (its local (start, size) parts, empty ones left out).

    Why every range and not consecutive rows: a zigzag block is an early and a late chunk, and a
    member before this rank on the ring is seen by both query chunks on its early chunk only, one
    after it by the late query chunk on both; a piece of consecutive rows lies in one chunk, so a step
    cost one rank twice another's and the ring, whose every step waits for the neighbour's previous
    one, ran at the slower rank's pace (measured at 16k on 2 processes: 18% of the time in waits).
    The same share of both chunks makes every step's causal work equal on every rank."""
    parts: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    off = 0
    for size in sizes:
        for j, (a, n) in enumerate(_cuts(size, count)):
            if n:
                parts[j].append((off + a, n))
        off += size
    return [tuple(p) for p in parts]


def _sub_rows(rows: tuple, piece: tuple) -> tuple:
    """The global ranges of the local rows `piece` ((start, size) parts) of a rank holding `rows`
    (global ranges, local order)."""
    out = []
    for start, n in piece:
        off = 0
        for a, m in rows:
            lo, hi = max(start, off), min(start + n, off + m)
            if lo < hi:
                out.append((a + lo - off, hi - lo))
            off += m
    return tuple(out)


def _blocks(q_rows: tuple, k_rows: tuple, causal: bool) -> list[Block]:
    """The kernel calls that attend query rows `q_rows` to key rows `k_rows` (global ranges in local
    order, each increasing): one call on the whole where it can, the causal mask only where both sides
    are the same rows (the kernel's mask aligns them at their first row).

    Causal: key rows before a query chunk are seen by all of it, key rows it shares are its diagonal
    (the kernel's mask on those rows), key rows after it are hidden; unmasked calls on adjacent rows
    are merged, so a contiguous or zigzag block is one or two calls.
    """
    q_n, k_n = sum(n for _, n in q_rows), sum(n for _, n in k_rows)
    if q_n == 0 or k_n == 0:
        return []
    if not causal:
        return [((0, q_n), (0, k_n), False)]
    if q_rows == k_rows:  # the same rows in the same increasing order: the kernel's mask is exact
        return [((0, q_n), (0, k_n), True)]
    calls: list = []
    q_off = 0
    for qa, qn in q_rows:
        k_off = 0
        for ka, kn in k_rows:
            calls += _causal_pair(qa, qn, q_off, ka, kn, k_off)
            k_off += kn
        q_off += qn
    return _merged(calls)


def _causal_pair(qa: int, qn: int, qo: int, ka: int, kn: int, ko: int) -> list[Block]:
    """Causal calls for global query rows [qa, qa+qn) at local offset qo against key rows [ka, ka+kn) at ko."""
    qb, kb = qa + qn, ka + kn
    calls = []
    if min(kb, qa) > ka:  # keys before the first query row: seen by every query row
        calls.append(((qo, qn), (ko, min(kb, qa) - ka), False))
    start, end = max(ka, qa), min(qb, kb)
    if start < end:  # rows on both sides: query row r sees keys start..r, the kernel's mask from `start`
        calls.append(((qo + start - qa, end - start), (ko + start - ka, end - start), True))
    if start < kb < qb:  # query rows after the last key see every key from `start`
        calls.append(((qo + kb - qa, qb - kb), (ko + start - ka, kb - start), False))
    return calls


def _merged(calls: list) -> list[Block]:
    """Unmasked calls on the same query rows and adjacent keys, or the same keys and adjacent query
    rows, as one call."""
    calls = list(calls)
    changed = True
    while changed:
        changed = False
        for x, y in itertools.permutations(range(len(calls)), 2):
            (qx, kx, mx), (qy, ky, my) = calls[x], calls[y]
            if mx or my:
                continue
            if qx == qy and kx[0] + kx[1] == ky[0]:
                calls[x] = (qx, (kx[0], kx[1] + ky[1]), False)
            elif kx == ky and qx[0] + qx[1] == qy[0]:
                calls[x] = ((qx[0], qx[1] + qy[1]), kx, False)
            else:
                continue
            del calls[y]
            changed = True
            break
    return calls


def _rows_of(t: torch.Tensor, piece: tuple[int, int]) -> torch.Tensor:
    start, n = piece
    return t if (start, n) == (0, t.shape[SEQ]) else t.narrow(SEQ, start, n)


def _take(t: torch.Tensor, piece: tuple) -> torch.Tensor:
    """The local rows of a key/value piece ((start, size) parts) as one tensor: a view of one part, a
    copy of several (the message sent is a contiguous copy either way)."""
    if len(piece) == 1:
        return _rows_of(t, piece[0])
    if not piece:
        return t.narrow(SEQ, 0, 0)
    return torch.cat([t.narrow(SEQ, a, n) for a, n in piece], SEQ)


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


def _piece_shape(t: torch.Tensor, piece: tuple) -> tuple:
    return tuple(t.shape[:SEQ]) + (sum(n for _, n in piece),) + tuple(t.shape[SEQ + 1:])


@dataclass
class _Pieces:
    """How the key/value blocks of a ring travel: the same number of pieces for every member (all
    members iterate alike), each member's block cut into them (`_range_cuts`), and its rows."""
    count: int
    cuts: dict[int, list[tuple]]
    rows: dict[int, tuple]


def _pieces(ring: Ring, layout: Layout, shape: tuple, most: int) -> _Pieces:
    rows = {m: _rows(layout, shape, m) for m in ring.members}
    # the kernel calls are a piece's part of one range: `MIN_PIECE_ROWS` bounds those
    count = pieces_of(max((n for r in rows.values() for _, n in r), default=0), most)
    return _Pieces(count, {m: _range_cuts([n for _, n in r], count) for m, r in rows.items()}, rows)


def ring_forward(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = args[:3]
    causal = bool(where.ctx.arg(4, "is_causal", False))
    scale = kwargs.get("scale")
    if where.checking:
        return func(q, k, v, 0.0, causal, scale=scale)
    comm, ring = context.current(), ring_of(where.in_layouts[1], where.rank)
    n = len(ring.members)
    q_rows = _rows(where.in_layouts[0], where.ctx.shapes[0], where.rank)
    kv = _pieces(ring, where.in_layouts[1], where.ctx.shapes[1], FORWARD_PIECES)
    out = lse = None
    for j in range(kv.count):
        mine = kv.cuts[where.rank][j]
        held = {"k": _take(k, mine), "v": _take(v, mine)}
        for step in range(n):
            holder = ring.holder(step)
            arriving = None
            if step < n - 1:  # the next piece travels while this one is computed
                source = kv.cuts[ring.holder(step + 1)][j]
                arriving = _pass_on(comm, ring, held, {"k": _piece_shape(k, source), "v": _piece_shape(v, source)},
                                    k.dtype, ("fwd", j, step))
            k_rows = _sub_rows(kv.rows[holder], kv.cuts[holder][j])
            # an empty shard (uneven heads or batch) attends nothing: the CPU kernels divide by its size
            blocks = _blocks(q_rows, k_rows, causal) if q.numel() and held["k"].numel() else []
            for q_piece, k_piece, masked in blocks:
                o, l = _attend(func, _rows_of(q, q_piece), _rows_of(held["k"], k_piece),
                               _rows_of(held["v"], k_piece), masked, scale)
                if out is None and q_piece == (0, q.shape[SEQ]):
                    out, lse = o.to(l.dtype), l
                    continue
                if out is None:  # rows no block has reached yet: nothing seen (zero weight, log-sum-exp -inf)
                    out = q.new_zeros(q.shape[:-1] + v.shape[-1:], dtype=l.dtype)
                    lse = torch.full(q.shape[:-1], -torch.inf, dtype=l.dtype, device=q.device)
                rows = slice(q_piece[0], q_piece[0] + q_piece[1])
                _, lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], o, l)
                del o, l
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


def ring_backward(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> tuple:
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
    kv = _pieces(ring, where.in_layouts[2], where.ctx.shapes[2], PIECES)
    q_pieces = [(p, _sub_rows(q_rows, (p,))) for p in _cuts(q.shape[SEQ], pieces_of(q.shape[SEQ], QUERY_PIECES))]
    queries = _Queries(func, grad_out, q, out, lse, q_pieces, causal, scale)
    grads: dict[str, Optional[torch.Tensor]] = {"q": None, "k": None, "v": None}
    sent = None  # the accumulator passed on last
    home = None  # this rank's own accumulator piece on its last hop: (piece, finish)
    for j in range(kv.count):
        mine = kv.cuts[where.rank][j]
        held = {"k": _take(k, mine), "v": _take(v, mine)}
        for step in range(n):
            owner = ring.holder(step)
            piece = kv.cuts[owner][j]
            arriving = None
            if step < n - 1:
                source = kv.cuts[ring.holder(step + 1)][j]
                arriving = _pass_on(comm, ring, held, {"k": _piece_shape(k, source), "v": _piece_shape(v, source)},
                                    k.dtype, ("kv", j, step))
            # the accumulator of the piece held now comes from the previous member, which finished with it
            incoming = None if step == 0 else _receive(
                comm, ring, {"dk": _piece_shape(k, piece), "dv": _piece_shape(v, piece)}, k.dtype, ("grad", j, step))
            if sent is not None:  # its receiver has posted the receive (above): freed before the kernel's peak
                sent()
            dk, dv = _piece_backward(queries, held, _sub_rows(kv.rows[owner], piece), grads)
            if home is not None:  # landed after the compute, which it overlapped
                _land(home, grads, k, v)
                home = None
            if incoming is not None:
                acc = incoming()
                dk, dv = acc["dk"].add_(dk), acc["dv"].add_(dv)
            # after n - 1 hops the accumulator's next member is its owner
            sent = _pass_on(comm, ring, {"dk": dk, "dv": dv}, {}, k.dtype, ("grad", j, step + 1))
            del dk, dv
            if arriving is not None:
                held = arriving()
        home = (mine, _receive(comm, ring, {"dk": _piece_shape(k, mine), "dv": _piece_shape(v, mine)}, k.dtype,
                               ("grad", j, n)))
    _land(home, grads, k, v)
    sent()
    return torch.zeros_like(q) if grads["q"] is None else grads["q"], grads["k"], grads["v"]


class _Queries(NamedTuple):
    """This rank's side of a ring backward, the same for every key/value piece that passes by: the kernel,
    the query rows' tensors (gradient, queries, forward output, log-sum-exp) and their pieces."""
    func: Any
    grad_out: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    pieces: list      # (piece, its global rows) per query piece
    causal: bool
    scale: Any


def _piece_backward(queries: _Queries, held: dict, k_rows: tuple, grads: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One key/value piece's gradient from every query piece that sees it (adding the queries' gradient
    into `grads["q"]`); the query pieces keep the kernel's temporaries a piece's size."""
    func, grad_out, q, out, lse, q_pieces, causal, scale = queries
    dk = dv = None
    if q.numel() and held["k"].numel():
        for q_piece, q_piece_rows in q_pieces:
            for qq, k_piece, masked in _blocks(q_piece_rows, k_rows, causal):
                q_at = (q_piece[0] + qq[0], qq[1])
                pq = lambda t: _rows_of(t, q_at)
                pk = lambda t: _rows_of(t, k_piece)
                dq_, dk_, dv_ = _attend_backward(func, pq(grad_out), pq(q), pk(held["k"]), pk(held["v"]), pq(out),
                                                 pq(lse), masked, scale)
                if grads["q"] is None and q_at == (0, q.shape[SEQ]):
                    grads["q"] = dq_
                else:
                    if grads["q"] is None:
                        grads["q"] = torch.zeros_like(q)
                    pq(grads["q"]).add_(dq_)
                if dk is None and k_piece == (0, held["k"].shape[SEQ]):
                    dk, dv = dk_, dv_
                else:
                    if dk is None:
                        dk, dv = torch.zeros_like(held["k"]), torch.zeros_like(held["v"])
                    pk(dk).add_(dk_)
                    pk(dv).add_(dv_)
                del dq_, dk_, dv_
    if dk is None:
        dk, dv = torch.zeros_like(held["k"]), torch.zeros_like(held["v"])
    return dk, dv


def _land(home: tuple, grads: dict, k: torch.Tensor, v: torch.Tensor) -> None:
    """This rank's own key/value gradient piece, back after its round, into the gradients it returns."""
    piece, finish = home
    got = finish()
    if piece == ((0, k.shape[SEQ]),):
        grads["k"], grads["v"] = got["dk"], got["dv"]
        return
    if grads["k"] is None:
        grads["k"], grads["v"] = torch.empty_like(k), torch.empty_like(v)
    off = 0
    for start, n in piece:
        _rows_of(grads["k"], (start, n)).copy_(got["dk"].narrow(SEQ, off, n))
        _rows_of(grads["v"], (start, n)).copy_(got["dv"].narrow(SEQ, off, n))
        off += n


def _receive(comm: Any, ring: Ring, shapes: dict[str, tuple], dtype: torch.dtype,
             step: Any) -> Callable[[], dict[str, torch.Tensor]]:
    return _pass_on(comm, ring, {}, shapes, dtype, step)
