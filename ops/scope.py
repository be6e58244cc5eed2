"""Where the user named the layouts: inside such a module, a Partial output is not charged.

A module plan entry `ModuleLayout(output=B, input_grad=B)` says how the
module's output and input gradient are laid out, Megatron style: the user has
decided which reduction a Partial inside will get (the row-parallel output's
all-reduce). The cost model then takes Partial outputs as the user's plan
(free, as Megatron's pattern has them) instead of charging each one its
cheapest reduction, which is for code nobody laid out (a ZeRO layout, a MoE
layer). The depth is per thread (a simulated rank is a thread) and is part of
the decision key.
"""
from __future__ import annotations

import threading
from typing import Callable

from ..runtime import fiber


class _Depth(threading.local):
    value = 0


_DEPTH = _Depth()


def _set_depth(value: int) -> None:
    _DEPTH.value = value


fiber.inherit(lambda: _DEPTH.value, _set_depth, 0)  # a pipeline fiber runs in its creator's scope


def enter_named() -> None:
    _DEPTH.value += 1


def leave_named() -> None:
    _DEPTH.value = max(0, _DEPTH.value - 1)


def in_named() -> bool:
    return _DEPTH.value > 0


def enter_named_here() -> Callable[[], None]:
    """Enter the named scope on this thread; returns the matching leave, which leaves this thread's scope
    from whichever thread calls it (autograd runs a backward's final callbacks on the thread that called
    `backward()`, a CUDA backward's nodes on the device's own thread)."""
    enter_named()
    mine = _DEPTH.__dict__  # this thread's attributes of the thread-local

    def leave() -> None:
        mine["value"] = max(0, mine.get("value", 0) - 1)
    return leave
