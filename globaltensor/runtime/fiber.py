"""Fibers: a micro-batch's forward or backward that can stop at a stage boundary and resume later.

An interleaved pipeline schedule runs one micro-batch's forward on a rank several times, once per
virtual stage (chunk) the rank holds, with other micro-batches' work in between. The forward is one
unchanged global program, so the only way to stop it between two chunks is to run it on its own
thread and hand control back and forth: exactly one of a rank's fibers (or the rank itself) runs at a
time, so the program stays sequential per rank and the collectives keep their order.

Where a fiber stops is told by the stage boundaries it crosses (`cross`, called by the modules that
move inputs across placements, `module.py`): it stops before entering one of its rank's chunks after
having left one, forward (a received activation) and backward alike (a received gradient). So a
fiber's `resume()` runs exactly one chunk of work, whatever the model does between its stages.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from . import context


# Per-thread state a fiber starts with as its creator had it, and leaves at its default on its pooled
# thread: (read it on this thread, set it on this thread, its default). The layers above register theirs
# (ops/scope.py: the named-scope depth), so this floor imports none of them.
INHERITED: list[tuple[Callable[[], Any], Callable[[Any], None], Any]] = []


def inherit(read: Callable[[], Any], write: Callable[[Any], None], default: Any) -> None:
    INHERITED.append((read, write, default))


def _signal() -> threading.Lock:
    """A hand-off between two threads: `release()` lets the one waiting in `acquire()` go on. A lock taken at
    the start, released by the other thread (a plain lock allows that): hand-offs strictly alternate here, so
    one C lock does what a Semaphore(0) does, without its Python-level Condition (a fiber switch is four of
    these: about 28 -> 12 us CPU per resume, a loop of resumes)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class _Current(threading.local):
    fiber: Optional["Fiber"] = None


_CURRENT = _Current()


class Fiber:
    """`fn` run on its own thread in steps: each `resume()` runs it until it stops at a boundary
    (`cross`) or returns; an exception it raises is raised by the `resume()` that ran it.

    The thread is a pooled worker (`_Worker`), not a new one per fiber: a thread's first autograd
    forward and backward cost torch about a millisecond of per-thread setup, which an interleaved
    step (two fibers per micro-batch) would pay again every step."""

    def __init__(self, fn: Callable[[], Any], name: str = "gt-fiber") -> None:
        self._fn, self.name = fn, name
        self._comm = context.current_or_none()
        self._inherited = [read() for read, _, _ in INHERITED]  # the creator's, which the fiber starts in
        self._go = _signal()    # the fiber may run
        self._back = _signal()  # the resuming thread may go on
        self._started = False
        self._cancelled = False
        self._left = False  # whether this step has left one of the rank's chunks
        self.done = False
        self.result: Any = None
        self._error: Optional[BaseException] = None

    def _main(self) -> None:
        """The fiber's whole run, on a worker thread (which then goes back to its pool)."""
        self._go.acquire()
        context.set_thread(self._comm)  # a simulated rank's communicator is its thread's
        _CURRENT.fiber = self
        # e.g. the named scope (ops/scope.py), per thread: the fiber runs in its creator's, as a call would, and
        # leaves none behind on its pooled thread (a fiber cancelled inside a named module never leaves it)
        for (_, write, _), value in zip(INHERITED, self._inherited):
            write(value)
        try:
            self.result = self._fn()
        except _Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the resuming thread
            self._error = e
        finally:
            for _, write, default in INHERITED:
                write(default)
            _CURRENT.fiber = None
            self._fn = None  # the micro-batch's graph and tensors go with it
            self.done = True

    def resume(self) -> None:
        """Run until the next stop or the end (the calling thread waits meanwhile)."""
        if self.done:
            raise RuntimeError("Fiber.resume: the fiber has already finished")
        self._left = False
        if not self._started:
            self._started = True
            _Worker.take().run(self)
        self._go.release()
        self._back.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def cancel(self) -> None:
        """Unwind a stopped fiber (its step failed elsewhere): its thread ends instead of waiting forever
        inside a forward or an autograd backward, which would abort the process when it exits."""
        if self._started and not self.done:
            self._cancelled = True
            self._go.release()
            self._back.acquire()

    def _stop(self) -> None:
        self._back.release()
        self._go.acquire()
        if self._cancelled:
            raise _Cancelled()
        self._left = False


class _Worker:
    """A thread that runs fibers one after another; idle ones wait in a pool per resuming thread (a
    rank: its fibers are resumed from there only), and end after `IDLE_S` seconds unused."""
    IDLE_S = 30.0

    def __init__(self, pool: list, lock: threading.Lock) -> None:
        self._pool, self._lock = pool, lock
        self._job: Optional[Fiber] = None
        self._ready = _signal()
        threading.Thread(target=self._loop, name="gt-fiber", daemon=True).start()

    @staticmethod
    def take() -> "_Worker":
        if _POOLS.workers is None:
            _POOLS.workers, _POOLS.lock = [], threading.Lock()
        with _POOLS.lock:
            if _POOLS.workers:
                return _POOLS.workers.pop()
        return _Worker(_POOLS.workers, _POOLS.lock)

    def run(self, fiber: Fiber) -> None:
        self._job = fiber
        self._ready.release()

    def _loop(self) -> None:
        while True:
            if not self._ready.acquire(timeout=self.IDLE_S):
                with self._lock:
                    if self in self._pool:  # not taken meanwhile: end
                        self._pool.remove(self)
                        return
                continue  # taken just now: its fiber follows
            fiber, self._job = self._job, None
            me = threading.current_thread()
            me.name = fiber.name  # a thread named after a fiber is one still inside it
            try:
                fiber._main()
            finally:
                me.name = "gt-fiber"
                with self._lock:
                    self._pool.append(self)
                fiber._back.release()


class _Pools(threading.local):
    workers: Optional[list] = None
    lock: Optional[threading.Lock] = None


_POOLS = _Pools()


class _Cancelled(BaseException):
    """Raised inside a cancelled fiber where it stopped, to unwind it."""


def cross(entering: bool) -> None:
    """A stage boundary, seen from this rank: `entering` one of its chunks (an activation received in
    the forward, a gradient received in the backward) or leaving one (sent). Outside a fiber, nothing."""
    fiber = _CURRENT.fiber
    if fiber is None:
        return
    if not entering:
        fiber._left = True
    elif fiber._left:
        fiber._stop()


def in_fiber() -> bool:
    return _CURRENT.fiber is not None


__all__ = ["Fiber", "cross", "in_fiber"]
