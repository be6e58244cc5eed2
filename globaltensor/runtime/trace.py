"""What this rank is doing when it communicates, for `gt.comm_report()` to say why a collective ran.

A report needs context at the moment a collective is recorded: the op being dispatched, the
boxing route being executed, the module being run, a gradient bucket. Each of those places pushes
its part here, but only while a report is open somewhere (`FLAGS.on`): the dispatcher's cache-hit
path then pays one attribute read, and `Communicator._record` reads the context only for a log
that asks for it (a report's). State is per thread, because a simulated rank is a thread.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator


class _Flags:
    """`on`: some thread has a report open or watches its ops (`watching`); the hot paths test this one
    attribute and nothing else."""
    on = False
    reports = 0   # reports open, over all threads
    watchers = 0  # op watchers open, over all threads

    def refresh(self) -> None:
        self.on = self.reports > 0 or self.watchers > 0


FLAGS = _Flags()
_FLAGS_LOCK = threading.Lock()


class _State(threading.local):
    def __init__(self) -> None:
        self.ops: list = []        # (op, args) of the dispatched calls in progress, outermost first
        self.routes: list = []     # boxing routes being executed (innermost last), or a list of a bucket's
        self.why: list = []        # free-form reasons pushed by their owners ("gradient bucket of 12")
        self.frames: list = []     # module frames pushed by the report's hooks (globaltensor/tools/report.py)
        self.reporting = 0         # reports open on this thread
        self.watchers: list = []   # watch(func, args, kwargs, decision or None) of `watching()` blocks open here


STATE = _State()


@contextlib.contextmanager
def watching(watch: Callable[[Any, tuple, dict, Any], Any]) -> Iterator[None]:
    """Call `watch(func, args, kwargs, decision)` for every op this thread dispatches in the block, before it
    runs (decision None where a step plan steers it); where it returns a callable, that is called with the op's
    output. What `globaltensor/parallel/plain.py` verifies a module by, and a pipeline's replay records a forward by."""
    with _FLAGS_LOCK:
        FLAGS.watchers += 1
        FLAGS.refresh()
    STATE.watchers.append(watch)
    try:
        yield
    finally:
        STATE.watchers.remove(watch)
        with _FLAGS_LOCK:
            FLAGS.watchers -= 1
            FLAGS.refresh()


def push_op(op: Any, args: tuple) -> None:
    STATE.ops.append((op, args))


def pop_op() -> None:
    STATE.ops.pop()


def push_route(route: Any) -> None:
    STATE.routes.append(route)


def pop_route() -> None:
    STATE.routes.pop()


def push_why(why: str) -> None:
    STATE.why.append(why)


def pop_why() -> None:
    STATE.why.pop()
