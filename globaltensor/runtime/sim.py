"""The in-process simulator: each rank is a thread, collectives are in memory.

Ranks run one at a time and hand over only inside a collective (round-robin
among the ranks that can proceed), so a run is deterministic and each rank's
process-global state (torch, numpy and `random` RNGs) is saved and restored at
every switch, as if each rank were its own `torchrun` process. Because the
scheduler knows what every rank waits for, a mismatched or missing collective
is reported at once, naming the collective, instead of hanging.
"""
from __future__ import annotations

import copy
import random
import threading
import time
import traceback
from collections import deque
from functools import reduce
from typing import Any, Callable

import numpy as np
import torch

from .comm import Communicator
from .failure import CollectiveError, default_timeout, raise_rank_failure
from .topology import ONE_NODE, Topology, default_for, install

REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _capture_rng() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _restore_rng(state: tuple) -> None:
    cpu, cuda, np_state, py_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    np.random.set_state(np_state)
    random.setstate(py_state)


class _Rendezvous:
    """One collective call on one group, filled in as members arrive."""

    def __init__(self, kind: str, group: tuple, seq: int, meta: Any) -> None:
        self.kind, self.group, self.seq, self.meta = kind, group, seq, meta
        self.payloads: dict[int, Any] = {}
        self.results: dict[int, Any] = {}

    def describe(self) -> str:
        return f"{self.kind} on group {self.group} (call #{self.seq} on that group)"


def _complete(rv: _Rendezvous) -> None:
    g, p = rv.group, rv.payloads
    if rv.kind == "all_gather":
        for r in g:
            rv.results[r] = [p[q] if q == r else p[q].clone() for q in g]
    elif rv.kind == "reduce_scatter":
        op = REDUCE[rv.meta[0]]
        for j, r in enumerate(g):
            rv.results[r] = reduce(op, [p[q][j] for q in g]).clone()
    elif rv.kind == "all_reduce":
        total = reduce(REDUCE[rv.meta[0]], [p[q] for q in g])
        for r in g:
            rv.results[r] = total.clone()
    elif rv.kind == "all_to_all":
        for j, r in enumerate(g):
            rv.results[r] = [p[q][j] if q == r else p[q][j].clone() for q in g]
    elif rv.kind == "broadcast":
        src = rv.meta[0]
        for r in g:
            rv.results[r] = p[src] if r == src else p[src].clone()
    elif rv.kind == "all_gather_object":
        for r in g:
            rv.results[r] = copy.deepcopy([p[q] for q in g])
    else:  # pragma: no cover
        raise AssertionError(rv.kind)


class SimWorld:
    def __init__(self, world_size: int, timeout: float | None = None, device: str = "cpu",
                 topology: Topology = ONE_NODE) -> None:
        self.world_size = world_size
        self.topology = topology
        install(default_for("sim"))  # a world starts on the defaults (a model calibrated in another is not its)
        self.timeout = default_timeout() if timeout is None else timeout
        self.device = torch.device(device)
        self.cond = threading.Condition()
        self.turn = 0
        self.status = ["runnable"] * world_size  # runnable | blocked | done
        self.waiting: list[str | None] = [None] * world_size
        self.awaits: list[int | None] = [None] * world_size  # the rank a blocked receive waits on
        self.pending: dict[tuple, _Rendezvous] = {}
        self.seq: dict[tuple, int] = {}
        self.mail: dict[tuple[int, int], deque] = {}
        self.error: str | None = None
        self.rng: list[tuple | None] = [None] * world_size

    def communicator(self, rank: int) -> "SimCommunicator":
        return SimCommunicator(self, rank)

    # -- scheduling (call with self.cond held) ------------------------------
    def _abort(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        for r, s in enumerate(self.status):
            if s == "blocked":
                self.status[r] = "runnable"
        self.cond.notify_all()

    def _hand_over(self, rank: int) -> None:
        n = self.world_size
        for k in range(1, n + 1):
            r = (rank + k) % n
            if self.status[r] == "runnable":
                self.turn = r
                self.cond.notify_all()
                return
        blocked = [r for r in range(n) if self.status[r] == "blocked"]
        if blocked:
            lines = [f"rank {r} waits in {self.waiting[r]}" for r in blocked]
            done = [r for r in range(n) if self.status[r] == "done"]
            if done:
                lines.append(f"ranks {done} have finished without joining")
            self._abort("collective never completed (mismatched or missing collective): " + "; ".join(lines))
            self._hand_over(rank)

    def _check_abort(self) -> None:
        if self.error is not None:
            raise CollectiveError(self.error)

    def _wait_turn(self, rank: int, what: str | None) -> None:
        start = time.monotonic()
        while self.turn != rank:
            left = self.timeout - (time.monotonic() - start)
            if left <= 0 and self.error is None:
                self._abort(f"timed out after {self.timeout:g}s: rank {rank} waits in {what}")
            self.cond.wait(max(left, 0.05) if self.error is None else 0.05)

    def _block(self, rank: int, what: str) -> None:
        self.rng[rank] = _capture_rng()
        self.status[rank], self.waiting[rank] = "blocked", what
        self._hand_over(rank)
        self._wait_turn(rank, what)
        self.waiting[rank] = None
        _restore_rng(self.rng[rank])

    # -- collectives ----------------------------------------------------------
    def collective(self, rank: int, kind: str, group: tuple, meta: Any, payload: Any) -> Any:
        with self.cond:
            self._check_abort()
            seq = self.seq.get((rank, group), 0)
            self.seq[(rank, group)] = seq + 1
            rv = self.pending.get((group, seq))
            if rv is None:
                rv = self.pending[(group, seq)] = _Rendezvous(kind, group, seq, meta)
            elif (rv.kind, rv.meta) != (kind, meta):
                first = next(iter(rv.payloads))
                self._abort(f"collective mismatch on group {group} (call #{seq} on that group): "
                            f"rank {first} called {rv.kind}{rv.meta}, rank {rank} called {kind}{meta}")
                self._check_abort()
            rv.payloads[rank] = payload
            if len(rv.payloads) == len(group):
                del self.pending[(group, seq)]
                _complete(rv)
                for r in group:
                    if r != rank and self.status[r] == "blocked":
                        self.status[r] = "runnable"
            else:
                self._block(rank, rv.describe())
                if rank not in rv.results:  # woken by an abort, not by the last member arriving
                    self._check_abort()
            return rv.results.pop(rank)

    def send(self, src: int, dst: int, t: torch.Tensor, tag: int = 0) -> None:
        """Never waits for the receiver: the message waits in (src, dst, tag)'s mailbox."""
        with self.cond:
            self._check_abort()
            self.mail.setdefault((src, dst, tag), deque()).append(t.clone())
            if self.status[dst] == "blocked" and self.awaits[dst] == src:
                self.status[dst] = "runnable"

    def recv(self, dst: int, src: int, shape: tuple, dtype: torch.dtype, tag: int = 0, label: str = "") -> torch.Tensor:
        """`label`: what the message is for (`Communicator.p2p_label`), named if it never comes."""
        with self.cond:
            self._check_abort()
            box = self.mail.setdefault((src, dst, tag), deque())
            while not box:
                self._check_abort()
                self.awaits[dst] = src
                try:
                    self._block(dst, f"send_recv from rank {src}" + (f" ({label})" if label else ""))
                finally:
                    self.awaits[dst] = None
            t = box.popleft()
            if tuple(t.shape) != shape or t.dtype != dtype:
                self._abort(f"send_recv mismatch: rank {dst} expected {shape} {dtype} from rank {src}, "
                            f"got {tuple(t.shape)} {t.dtype}")
                self._check_abort()
            return t

    # -- running a program on every rank --------------------------------------
    def run(self, fn: Callable[[SimCommunicator], Any]) -> list[Any]:
        """`fn(communicator)` on every rank, each in its own thread; the results in rank order.

        `fn` is handed its rank's communicator (`launch` makes it the thread's current one).
        """
        if torch.cuda.is_available():  # started now, so that every rank starts from CUDA's generator state too
            torch.cuda.init()
        initial = _capture_rng()
        results: list[Any] = [None] * self.world_size
        errors: dict[int, tuple[BaseException, str]] = {}

        def body(rank: int) -> None:
            try:
                with self.cond:
                    self._wait_turn(rank, "the start")
                _restore_rng(initial)
                # backward in this thread: autograd runs CUDA work in its own device thread, which has no
                # rank (no communicator) and which the ranks would share (one rank's collective blocks all)
                with torch.autograd.set_multithreading_enabled(False):
                    results[rank] = fn(self.communicator(rank))
            except BaseException as e:  # noqa: BLE001 - reported to the caller with its rank
                errors[rank] = (e, traceback.format_exc())
            finally:
                with self.cond:
                    self.status[rank] = "done"
                    if rank in errors and not isinstance(errors[rank][0], CollectiveError):
                        self._abort(f"rank {rank} failed with {type(errors[rank][0]).__name__}: {errors[rank][0]}")
                    self._hand_over(rank)

        threads = [threading.Thread(target=body, args=(r,), name=f"gt-sim-rank{r}", daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.1)
                if self.error is not None and t.is_alive():
                    t.join(self.timeout)  # a rank busy outside collectives: wait once, then give up on it
                    if t.is_alive():
                        errors.setdefault(int(t.name[11:]), (CollectiveError(self.error), "(still running)\n"))
                        break
        _restore_rng(initial)
        if errors:
            raise_rank_failure(errors)
        return results


class SimCommunicator(Communicator):
    def __init__(self, world: SimWorld, rank: int) -> None:
        super().__init__()
        self.world, self.rank, self.world_size, self.device = world, rank, world.world_size, world.device
        self.topology = world.topology

    def _all_gather(self, t, group, shapes):
        return self.world.collective(self.rank, "all_gather", group, (t.dtype, tuple(shapes)), t)

    def _reduce_scatter(self, chunks, group, op):
        meta = (op, chunks[0].dtype, tuple(tuple(c.shape) for c in chunks))
        return self.world.collective(self.rank, "reduce_scatter", group, meta, list(chunks))

    def _all_reduce(self, t, group, op):
        return self.world.collective(self.rank, "all_reduce", group, (op, t.dtype, tuple(t.shape)), t)

    def _all_to_all_into(self, send, send_splits, recv, recv_splits, group):
        pieces = list(send.split(list(send_splits)))
        out = self.world.collective(self.rank, "all_to_all", group, (send.dtype,), pieces)
        for j, (t, target) in enumerate(zip(out, recv.split(list(recv_splits)))):
            if t.numel() != target.numel():
                raise CollectiveError(f"all_to_all on group {group}: rank {self.rank} expected {target.numel()} "
                                      f"elements from rank {group[j]}, got {t.numel()}")
            target.copy_(t)

    def _exchange(self, sends, bufs, tag=0):
        for dst, t in sends.items():
            self.world.send(self.rank, dst, t, tag)
        for src, buf in bufs.items():
            buf.copy_(self.world.recv(self.rank, src, tuple(buf.shape), buf.dtype, tag, self.p2p_label))

    def _exchange_start(self, sends, bufs, tag=0):
        """Sends are buffered at once; the receives wait in the result (the scheduler runs the peers)."""
        for dst, t in sends.items():
            self.world.send(self.rank, dst, t, tag)
        label = self.p2p_label

        def finish():
            for src, buf in bufs.items():
                buf.copy_(self.world.recv(self.rank, src, tuple(buf.shape), buf.dtype, tag, label))
            return bufs
        return finish

    def flush_sends(self) -> None:
        pass  # the simulator's sends are buffered: nothing in flight

    def _broadcast(self, t, group, src, shape, dtype):
        return self.world.collective(self.rank, "broadcast", group, (src, shape, dtype), t)

    def _all_gather_object(self, obj, group):
        return self.world.collective(self.rank, "all_gather_object", group, (), obj)
