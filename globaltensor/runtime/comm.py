"""The Communicator interface: the only code that talks to other ranks.

Every primitive takes this rank's local tensors and a `group` (global ranks in
mesh order, containing this rank), returns new local tensors, and records what
this rank received under DESIGN.md's byte convention, so that routes and logs
count the same way on every backend. Backends implement the `_`-prefixed raw
methods only.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Any, Sequence

import torch

from ..sbp import split_sizes
from . import graph_ops
from .topology import ONE_NODE
from .trace import FLAGS as _TRACING, STATE as _TRACE

Group = tuple  # of int ranks, in mesh order


@dataclass(frozen=True)
class CommEvent:
    kind: str
    group: tuple[int, ...]
    recv_bytes: int
    across: bool = False  # its group spans nodes (runtime/topology.py)
    # a symmetric dry run's event stands for the ranks its one rank was run for (runtime/symmetry.py): ((rank,
    # recv_bytes), ...) of those taking part; empty: this rank's alone
    by_rank: tuple = ()


@dataclass
class CommLog:
    events: list[CommEvent] = field(default_factory=list)

    @property
    def recv_bytes(self) -> int:
        return sum(e.recv_bytes for e in self.events)

    def per_rank(self, ranks: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Each of `ranks`' (received bytes, communications): a symmetric dry run's log stands for several ranks
        (`CommEvent.by_rank`); another log's events are its own rank's, whichever it is among `ranks`."""
        out = {r: [0, 0] for r in ranks}
        for e in self.events:
            for r, b in (e.by_rank or ((r, e.recv_bytes) for r in ranks)):
                if r in out:
                    out[r][0] += b
                    out[r][1] += 1
        return {r: (b, n) for r, (b, n) in out.items()}

    def by_link(self) -> dict[str, int]:
        """Bytes received in collectives whose group spans nodes ("across") and in the rest ("inside")."""
        out = {"inside": 0, "across": 0}
        for e in self.events:
            out["across" if e.across else "inside"] += e.recv_bytes
        return out

    def add(self, event: CommEvent) -> None:
        """Called by the communicator for each collective; a report's log also notes why (report.py)."""
        self.events.append(event)

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.events:
            out[e.kind] = out.get(e.kind, 0) + e.recv_bytes
        return out


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def all_reduce_recv_bytes(numel: int, itemsize: int, n: int, index: int) -> int:
    """Reduce-scatter then all-gather over array_split chunks: 2(n-1)/n|T| when even."""
    chunk = split_sizes(numel, n)[index]
    return ((n - 1) * chunk + (numel - chunk)) * itemsize


class _Count(threading.local):
    n = 0


_COUNT = _Count()


def communications() -> int:
    """How many communications (collectives, point-to-point exchanges) this thread has taken part in: a pipeline
    learns after which one a rank's part of a micro-batch's forward is over (`gt.Pipeline(leave_early=)`)."""
    return _COUNT.n


class PostedMismatch(RuntimeError):
    """A receive posted ahead (`Communicator.post_receive`) does not fit the exchange that asks for it: the program's
    messages changed since it was posted. Whoever posted it says how to opt out (`gt.Pipeline(post_receives=)`)."""


class Communicator:
    rank: int
    world_size: int
    device: torch.device

    def __init__(self) -> None:
        self._logs: list[CommLog] = []
        self.topology = ONE_NODE  # which ranks share a node (runtime/topology.py)
        self._scratch: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> buffer
        # point-to-point matching (pipelines): messages between two ranks are matched by tag, in program
        # order within a tag, never by arrival; with `p2p_async` a send returns at once (`flush_sends` waits)
        self.p2p_tag = 0
        self.p2p_async = False
        self.p2p_wait_s = 0.0  # seconds spent in point-to-point calls while p2p_async (a pipeline's idle time)
        # what the point-to-point messages now exchanged are for (a pipeline names the action and micro-batch),
        # so that a stalled one is named by it: two stages whose schedules disagree say which message each awaits
        self.p2p_label = ""
        # receives posted ahead of the exchange that asks for them (`post_receive`), by (source, tag), in
        # posting order
        self._posted: dict[tuple[int, int], list[tuple[Callable[[], Any], torch.Tensor]]] = {}
        # whether a receive posted ahead leaves the sends posted after it free to go (gloo, the simulator); not
        # on nccl, whose point-to-point kernels run in order on one stream: a receive posted early would hold
        # back this rank's later sends, on which its sender may be waiting
        self.posts_receives_ahead = True
        # where a list, each receive `exchange` makes is noted in it: (source, key, shape, dtype, device), so a
        # pipeline learns which messages each of its actions receives
        self.p2p_heard: list | None = None
        # where set, called after each `exchange` with (sends, recvs, key, what was received, device): a pipeline
        # recording the messages of a rank's part (globaltensor/parallel/replay.py)
        self.p2p_record: Callable[[dict, dict, int, dict, Any], None] | None = None

    # -- accounting -------------------------------------------------------
    def _record(self, kind: str, group: Group, recv_bytes: int) -> None:
        if self._logs:
            ev = CommEvent(kind, tuple(group), int(recv_bytes), self.topology.crosses(group))
            for log in self._logs:
                log.add(ev)

    def _index(self, group: Group, kind: str) -> int:
        _COUNT.n += 1
        if _TRACING.on:  # a report's chrome trace: when this collective started (every primitive asks here first)
            _TRACE.t0 = time.perf_counter_ns()
        try:
            return group.index(self.rank)
        except ValueError:
            raise ValueError(f"{kind}: rank {self.rank} is not in group {group}") from None

    # -- primitives -------------------------------------------------------
    def all_gather(self, t: torch.Tensor, group: Group,
                   shapes: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
        """Every member's tensor, in group order. `shapes` (one per member) allows uneven pieces."""
        i = self._index(group, "all_gather")
        if len(group) == 1:
            return [t]
        shapes = [tuple(t.shape)] * len(group) if shapes is None else [tuple(s) for s in shapes]
        if shapes[i] != tuple(t.shape):
            raise ValueError(f"all_gather: shapes[{i}]={shapes[i]} but this rank's tensor is {tuple(t.shape)}")
        if graph_ops.traced(t):  # torch.compile is tracing: recorded as a graph op, run by this method later
            return self._traced_all_gather(t.contiguous(), group, shapes)
        out = self._all_gather(t.contiguous(), group, shapes)
        if self._logs:  # the byte count is only worked out for a log
            self._record("all_gather", group, sum(nbytes(s, t.dtype) for j, s in enumerate(shapes) if j != i))
        return out

    def all_gather_start(self, t: torch.Tensor, group: Group, shapes: Sequence[Sequence[int]]
                         ) -> Callable[[], list[torch.Tensor]]:
        """`all_gather`, started now and finished by calling the result (a prefetch: the backend may
        move the data while this rank computes; gloo does, the simulator finishes at once)."""
        i = self._index(group, "all_gather")
        shapes = [tuple(s) for s in shapes]
        if len(group) == 1 or not self._async_gather or graph_ops.traced(t):
            out = self.all_gather(t, group, shapes)
            return lambda: out
        finish = self._all_gather_start(t.contiguous(), group, shapes)
        if self._logs:
            self._record("all_gather", group, sum(nbytes(s, t.dtype) for j, s in enumerate(shapes) if j != i))
        return finish

    _async_gather = False  # backends that can leave a collective in flight set it and define *_start

    def reduce_scatter_start(self, chunks: Sequence[torch.Tensor], group: Group, op: str = "sum"
                             ) -> Callable[[], torch.Tensor]:
        """`reduce_scatter`, started now and finished by calling the result (gloo: in flight while
        this rank computes, where the chunks are one buffer of equal pieces; else done at once)."""
        i = self._index(group, "reduce_scatter")
        finish = None
        if len(group) > 1 and self._async_gather and len(chunks) == len(group) and not graph_ops.traced(chunks[i]):
            finish = self._reduce_scatter_start([c.contiguous() for c in chunks], group, op)
        if finish is None:
            out = self.reduce_scatter(chunks, group, op)
            return lambda: out
        if self._logs:
            self._record("reduce_scatter", group, (len(group) - 1) * chunks[i].numel() * chunks[i].element_size())
        return finish

    def reduce_scatter(self, chunks: Sequence[torch.Tensor], group: Group, op: str = "sum") -> torch.Tensor:
        """chunks[j] is this rank's contribution to member j; returns the reduced own chunk."""
        i = self._index(group, "reduce_scatter")
        if len(chunks) != len(group):
            raise ValueError(f"reduce_scatter: {len(chunks)} chunks for a group of {len(group)}")
        if len(group) == 1:
            return chunks[0]
        if graph_ops.traced(chunks[i]):
            return self._traced_reduce_scatter(chunks, group, op, i)
        out = self._reduce_scatter([c.contiguous() for c in chunks], group, op)
        if self._logs:
            self._record("reduce_scatter", group, (len(group) - 1) * chunks[i].numel() * chunks[i].element_size())
        return out

    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
        i = self._index(group, "all_reduce")
        if len(group) == 1:
            return t
        if graph_ops.traced(t):
            return self._traced_all_reduce(t, group, op)
        out = self._all_reduce(t.contiguous(), group, op)
        if self._logs:
            self._record("all_reduce", group, all_reduce_recv_bytes(t.numel(), t.element_size(), len(group), i))
        return out

    def all_to_all(self, sends: Sequence[torch.Tensor], group: Group,
                   recv_shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """sends[j] goes to member j; returns what each member sent here (shapes given, uneven allowed)."""
        if len(sends) != len(group) or len(recv_shapes) != len(group):
            raise ValueError(f"all_to_all: need one send and one recv shape per member of {group}")
        recv_shapes = [tuple(s) for s in recv_shapes]
        recv_splits = [math.prod(s) for s in recv_shapes]
        send = torch.cat([t.reshape(-1) for t in sends])
        recv = self.all_to_all_into(send, [t.numel() for t in sends], send.new_empty(sum(recv_splits)),
                                    recv_splits, group)
        return [piece.view(s) for piece, s in zip(recv.split(recv_splits), recv_shapes)]

    def all_to_all_into(self, send: torch.Tensor, send_splits: Sequence[int], recv: torch.Tensor,
                        recv_splits: Sequence[int], group: Group) -> torch.Tensor:
        """Flat all-to-all: segment j of `send` goes to member j, segment j of `recv` is filled from it.

        `send` and `recv` are flat contiguous tensors of one dtype, cut into segments of
        `send_splits` / `recv_splits` elements in group order. The caller packs and unpacks,
        since it knows the boxes: the executor packs with one copy, or none, where `all_to_all`'s
        list of pieces would cost a copy each. Returns `recv`.
        """
        i = self._index(group, "all_to_all")
        if len(send_splits) != len(group) or len(recv_splits) != len(group):
            raise ValueError(f"all_to_all: need one send and one recv split per member of {group}")
        if sum(send_splits) != send.numel() or sum(recv_splits) != recv.numel():
            raise ValueError(f"all_to_all: splits {list(send_splits)} / {list(recv_splits)} do not add up to the "
                             f"buffers' {send.numel()} / {recv.numel()} elements")
        if len(group) == 1:
            return recv.copy_(send)
        if graph_ops.traced(send):
            return recv.copy_(self._traced_all_to_all(send, send_splits, recv_splits, group))
        self._all_to_all_into(send, send_splits, recv, recv_splits, group)
        if self._logs:
            self._record("all_to_all", group, (recv.numel() - recv_splits[i]) * recv.element_size())
        return recv

    def device_for(self, device_type: str) -> torch.device:
        """Where this rank keeps the shards of a placement of `device_type` ("cpu" or "cuda").

        Its own device where the types agree (nccl: cuda:LOCAL_RANK); else the type's current
        device (the simulator's ranks share one GPU, and a gloo rank may hold cuda tensors).
        """
        if device_type == self.device.type:
            return self.device
        if device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError("placement(device_type): 'cuda' but this process has no CUDA device; use 'cpu'")
        return torch.device(device_type)

    def send_buffer(self, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """A reused flat buffer (on `device`, default this rank's) to pack what one collective sends;
        valid until the next call.

        Collectives complete before returning (on nccl, in stream order), so the next call may
        overwrite it; reuse spares a fresh allocation, and its page faults, each call.
        """
        if graph_ops.tracing_now():  # torch.compile: a fresh buffer of the graph's, never the process's reused one
            return torch.empty(numel, dtype=dtype, device=device or self.device)
        key = (dtype, device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, dtype=dtype, device=device or self.device)
        return buf[:numel]

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, tuple[Sequence[int], torch.dtype]],
                 into: dict[int, torch.Tensor] | None = None, device: torch.device | None = None,
                 key: int = 0) -> dict[int, torch.Tensor]:
        """Point-to-point: send sends[r] to rank r, receive recvs[r] = (shape, dtype) from rank r.

        `key` names the conversion the messages belong to (the same number on both sides): with
        `p2p_tag` it makes the tag, so messages of different conversions never match each other even
        when two ranks run them in different orders (a pipeline's stages).

        `into[r]`, where given, is a contiguous tensor of that shape and dtype to receive into (a
        view of the caller's output, which then needs no copy); it is what is returned for r.
        Other receive buffers are made on `device` (default this rank's).
        """
        if not sends and not recvs:
            self._receive_buffers("exchange", sends, recvs, into, device)  # checks the peers
            return {}
        if any(graph_ops.traced(t) for t in sends.values()) or graph_ops.traced(next(iter((into or {}).values()), None)):
            raise graph_ops.untraceable("a point-to-point exchange")
        _COUNT.n += 1
        tag = self._tag(key)
        posted = self._claim(recvs, tag) if self._posted else None
        rest = {r: v for r, v in recvs.items() if r not in posted} if posted else recvs
        bufs = self._receive_buffers("exchange", sends, rest, into, device)
        if self.p2p_heard is not None:
            self.p2p_heard.extend((r, key, tuple(shape), dtype, device) for r, (shape, dtype) in recvs.items())
        if self.p2p_async:  # a pipeline: the time spent here is time this rank waits on another stage
            t0 = time.perf_counter()
            self._exchange_with(sends, bufs, tag, posted, into)
            self.p2p_wait_s += time.perf_counter() - t0
        else:
            self._exchange_with(sends, bufs, tag, posted, into)
        self._record_send_recv(sends, recvs)
        if self.p2p_record is not None:
            self.p2p_record(sends, recvs, key, bufs, device)
        return bufs

    def _exchange_with(self, sends: dict, bufs: dict, tag: int, posted: dict | None, into: dict | None) -> None:
        """`_exchange` of what was not posted ahead, then the posted receives' waits (into `bufs`)."""
        if sends or bufs:
            self._exchange({r: t.contiguous() for r, t in sends.items()}, bufs, tag)
        for r, (finish, buf) in (posted or {}).items():
            finish()
            target = (into or {}).get(r)
            if target is not None:
                target.copy_(buf)
                buf = target
            bufs[r] = buf

    def post_receive(self, src: int, shape: Sequence[int], dtype: torch.dtype, key: int = 0,
                     device: torch.device | None = None) -> None:
        """Receive now what `src` will send to the `exchange` of this `key` under the current `p2p_tag`; that
        exchange waits on this receive instead of posting its own.

        Why: a send and its receive are matched only once both are posted (gloo's tcp pairs move the data
        when the receiver asks), so a receive posted when its stage's action starts waits a round trip
        behind a sender that finished long before. A pipeline, whose steps repeat, posts the receives of
        its next actions while it computes the current one, as torch.pipelining's runtime schedules do.
        Every posted receive must be asked for (`posted_left` names those that were not). Receives under one
        source and tag are matched in the order they are posted, as messages under one tag are sent."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=device or self.device)
        tag = self._tag(key)
        self._posted.setdefault((src, tag), []).append((self._exchange_start({}, {src: buf}, tag), buf))

    def posted_left(self) -> list[tuple[int, int]]:
        """The (source, tag) of receives posted and not yet asked for; forgotten (their messages are lost to
        this rank's program: a caller raises)."""
        left = [k for k, q in self._posted.items() for _ in q]
        self._posted = {}
        return left

    def _claim(self, recvs: dict, tag: int) -> dict:
        """The posted receives among `recvs` (by source and tag), taken out; one whose shape or dtype is not the
        exchange's means the program's messages changed since they were learnt: an error, not a wrong match."""
        got = {}
        for r, (shape, dtype) in recvs.items():
            queue = self._posted.get((r, tag))
            if not queue:
                continue
            hit = queue.pop(0)
            if not queue:
                del self._posted[(r, tag)]
            if tuple(hit[1].shape) != tuple(shape) or hit[1].dtype != dtype:
                raise PostedMismatch(
                    f"rank {self.rank}: a receive from rank {r} posted ahead (tag {tag}) holds "
                    f"{tuple(hit[1].shape)} {hit[1].dtype}, but the program now receives {tuple(shape)} {dtype} "
                    f"there ({self.p2p_label or 'point-to-point'}): its messages changed since the receive was "
                    f"posted")
            got[r] = hit
        return got

    def send_recv_start(self, sends: dict[int, torch.Tensor],
                        recvs: dict[int, tuple[Sequence[int], torch.dtype]], key: int = 0,
                        device: torch.device | None = None) -> Callable[[], dict[int, torch.Tensor]]:
        """`exchange`, started now and finished by calling the result (what each peer sent).

        So a rank computes while its messages travel (ring attention passes the next block while it
        works on the current one). Counted when started, as `exchange` counts it. The tensors sent
        must stay unchanged until the result is called; every started exchange must be finished.
        """
        bufs = self._receive_buffers("send_recv_start", sends, recvs, None, device)
        if not sends and not recvs:
            return lambda: {}
        if any(graph_ops.traced(t) for t in sends.values()):
            raise graph_ops.untraceable("a point-to-point exchange")
        _COUNT.n += 1
        finish = self._exchange_start({r: t.contiguous() for r, t in sends.items()}, bufs, self._tag(key))
        self._record_send_recv(sends, recvs)
        return finish

    def _receive_buffers(self, kind: str, sends: dict, recvs: dict, into: dict | None,
                         device: torch.device | None) -> dict[int, torch.Tensor]:
        if self.rank in sends or self.rank in recvs:
            raise ValueError(f"{kind}: rank {self.rank} cannot send to or receive from itself")
        into = into or {}
        bufs = {}
        for r, (shape, dtype) in recvs.items():
            buf = into.get(r)
            if buf is None:
                buf = torch.empty(tuple(shape), dtype=dtype, device=device or self.device)
            elif tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or not buf.is_contiguous():
                raise ValueError(f"{kind}(into): the buffer for rank {r} must be a contiguous {tuple(shape)} "
                                 f"{dtype} tensor, got {tuple(buf.shape)} {buf.dtype}")
            bufs[r] = buf
        return bufs

    def _tag(self, key: int) -> int:
        return (self.p2p_tag * 1_000_003 + key) % 2**31 if key else self.p2p_tag

    def _record_send_recv(self, sends: dict, recvs: dict) -> None:
        if self._logs:
            peers = tuple(sorted(set(sends) | set(recvs) | {self.rank}))
            self._record("send_recv", peers, sum(nbytes(s, d) for s, d in recvs.values()))

    def broadcast(self, t: torch.Tensor | None, group: Group, src: int,
                  shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Member `src` (a global rank) sends its tensor; every member returns it."""
        self._index(group, "broadcast")
        if src not in group:
            raise ValueError(f"broadcast: src rank {src} is not in group {group}")
        if len(group) == 1:
            return t
        if graph_ops.traced(t):
            raise graph_ops.untraceable("a broadcast")
        out = self._broadcast(t.contiguous() if self.rank == src else None, group, src, tuple(shape), dtype)
        if self._logs:
            self._record("broadcast", group, 0 if self.rank == src else nbytes(shape, dtype))
        return out

    def all_gather_object(self, obj: Any, group: Group) -> list[Any]:
        """Small metadata (shapes, checks); counted as an event with no tensor bytes."""
        self._index(group, "all_gather_object")
        if len(group) == 1:
            return [obj]
        if graph_ops.compiling():
            raise graph_ops.untraceable("an all-gather of Python objects (shapes only the run can tell)")
        out = self._all_gather_object(obj, group)
        self._record("all_gather_object", group, 0)
        return out

    def barrier(self, group: Group | None = None) -> None:
        self.all_gather_object(None, tuple(range(self.world_size)) if group is None else group)

    # -- under torch.compile: the collectives as graph ops (runtime/graph_ops.py) -----------------
    # a backend whose collectives torch can trace itself (torch.distributed's functional collectives) overrides
    # these; the default records ops of our own that call this rank's communicator when the graph runs
    def _traced_all_gather(self, t: torch.Tensor, group: Group, shapes: Sequence[tuple]) -> list[torch.Tensor]:
        return graph_ops.gather(t, group, shapes)

    def _traced_reduce_scatter(self, chunks: Sequence[torch.Tensor], group: Group, op: str, i: int) -> torch.Tensor:
        return graph_ops.scatter_reduce(chunks, group, op, i)

    def _traced_all_reduce(self, t: torch.Tensor, group: Group, op: str) -> torch.Tensor:
        return graph_ops.reduce(t, group, op)

    def _traced_all_to_all(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                           group: Group) -> torch.Tensor:
        return graph_ops.to_all(send, send_splits, recv_splits, group)

    # -- backend hooks ----------------------------------------------------
    def _all_gather(self, t, group, shapes):  # pragma: no cover - interface
        raise NotImplementedError

    def _reduce_scatter(self, chunks, group, op):  # pragma: no cover
        raise NotImplementedError

    def _all_reduce(self, t, group, op):  # pragma: no cover
        raise NotImplementedError

    def _all_to_all_into(self, send, send_splits, recv, recv_splits, group):  # pragma: no cover
        raise NotImplementedError

    def _exchange(self, sends, bufs, tag):  # pragma: no cover - fill bufs[r] with what rank r sends
        raise NotImplementedError

    def _exchange_start(self, sends, bufs, tag):
        """Start `_exchange`; the result waits for it and returns `bufs` (default: done at once)."""
        self._exchange(sends, bufs, tag)
        return lambda: bufs

    def flush_sends(self) -> None:
        """Wait for the asynchronous sends still in flight (a pipeline step's end)."""

    def _broadcast(self, t, group, src, shape, dtype):  # pragma: no cover
        raise NotImplementedError

    def _all_gather_object(self, obj, group):  # pragma: no cover
        raise NotImplementedError

