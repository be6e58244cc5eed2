"""Which Communicator the calling rank uses.

Simulated ranks are threads, so the communicator is thread-local first; a
`torchrun` process has one for the whole process, created on first use from
the usual environment variables; a plain script is a world of one.
"""
from __future__ import annotations

import os
import threading

from .comm import Communicator



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


def set_thread(comm: Communicator | None) -> None:
    _local.comm = comm


def set_process(comm: Communicator | None) -> None:
    global _process
    _process = comm


def _init_process() -> Communicator:
    import torch.distributed as dist
    global _process, _alone
    if dist.is_available() and (dist.is_initialized() or "WORLD_SIZE" in os.environ and "RANK" in os.environ):
        from .dist import TorchDistCommunicator
        _process = TorchDistCommunicator.from_environment()
        return _process
    from .sim import SimWorld
    _alone = SimWorld(1).communicator(0)
    return _alone


def rank() -> int:
    return current().rank


def world_size() -> int:
    return current().world_size
