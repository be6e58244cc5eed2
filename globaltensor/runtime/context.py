"""Which Communicator the calling rank uses, and the log of what it receives.

Simulated ranks are threads, so the communicator is thread-local first (`launch`
binds each simulated rank's); a `torchrun` process has one for the whole process,
created on first use from the usual environment variables; a plain script is a
world of one.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch.distributed as dist

from . import graph_ops
from .comm import CommLog, Communicator
from .dist import TorchDistCommunicator
from .sim import SimWorld


class _Thread(threading.local):
    comm: Communicator | None = None  # a class default: reading it never raises (a dispatch hit reads it)


_local = _Thread()
_process: Communicator | None = None
_alone: Communicator | None = None  # the implicit world of one of a plain script


def current_or_none() -> Communicator | None:
    """The communicator of a launched rank or a torchrun process; None in a plain script."""
    return _local.comm or _process


def current() -> Communicator:
    comm = _local.comm or _process or _alone
    return comm if comm is not None else _init_process()


graph_ops.CURRENT.find = current  # what a compiled graph's collectives run on


def set_thread(comm: Communicator | None) -> None:
    _local.comm = comm


def set_process(comm: Communicator | None) -> None:
    global _process
    _process = comm


def _init_process() -> Communicator:
    global _process, _alone
    if dist.is_available() and (dist.is_initialized() or "WORLD_SIZE" in os.environ and "RANK" in os.environ):
        _process = TorchDistCommunicator.from_environment()
        return _process
    _alone = SimWorld(1).communicator(0)
    return _alone


def rank() -> int:
    """This process's (or simulated rank's) global rank; 0 outside `gt.launch` and torchrun."""
    return current().rank


def world_size() -> int:
    """The number of ranks of the running program; 1 outside `gt.launch` and torchrun."""
    return current().world_size


@contextlib.contextmanager
def comm_log() -> Iterator[CommLog]:
    """Record this rank's collectives: `with gt.comm_log() as log: ...; log.recv_bytes`."""
    comm = current()
    log = CommLog()
    comm._logs.append(log)
    try:
        yield log
    finally:  # by identity: CommLogs compare equal by their events (nested logs often hold the same)
        comm._logs[:] = [g for g in comm._logs if g is not log]
