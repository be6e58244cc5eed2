"""Where the layouts are named: inside such a scope, a Partial output is not charged.

A module plan entry `ModuleLayout(output=B, input_grad=B)` says how the
module's output and input gradient are laid out, Megatron style: the user has
decided which reduction a Partial inside will get (the row-parallel output's
all-reduce). The cost model then takes Partial outputs as the user's plan
(free, as Megatron's pattern has them) instead of charging each one its
cheapest reduction, which is for code nobody laid out (a MoE layer). A ZeRO
module's backward names only its parameters' gradients (reduce-scattered by
the module, so left Partial): there only outputs of its parameters' shapes
are excused. The scopes are per thread (a simulated rank is a thread) and are
part of the decision key.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional

from ..runtime import fiber


class _Scope(threading.local):
    """This thread's open scopes, innermost last: None excuses every Partial output (a module whose boundary
    layouts the user named), a frozenset of shapes only outputs of those shapes (a ZeRO module's backward:
    its parameters' gradients, which its reduce-scatter reduces; an activation's gradient left Partial there
    would be reduced whole by the op that reads it). `key` sums them up for the decision cache."""

    def __init__(self) -> None:
        self.entries: list = []
        self.key: tuple = ()


_SCOPE = _Scope()
_NAMED = "named"


def _rekey(state: dict) -> None:
    """`state`: one thread's attributes of `_SCOPE` (its `__dict__`, which another thread may hold too)."""
    entries = state["entries"]
    if not entries:
        state["key"] = ()
    elif any(e is None for e in entries):
        state["key"] = (_NAMED,)
    else:
        state["key"] = (_NAMED, frozenset().union(*entries))


def _inherit(value: tuple) -> None:
    _SCOPE.entries = list(value)
    _rekey(_SCOPE.__dict__)


fiber.inherit(lambda: tuple(_SCOPE.entries), _inherit, ())  # a pipeline fiber runs in its creator's scope


def _shapes(shapes: Optional[Iterable]) -> Optional[frozenset]:
    return None if shapes is None else frozenset(tuple(s) for s in shapes)


def enter_named(shapes: Optional[Iterable] = None) -> None:
    """Enter a scope excusing the Partial outputs of `shapes` (None: every one)."""
    _SCOPE.entries.append(_shapes(shapes))
    _rekey(_SCOPE.__dict__)


def leave_named(shapes: Optional[Iterable] = None) -> None:
    """Leave one scope entered with `shapes` (the innermost such): scopes are not left in the order they were
    entered (a backward leaves a module's where its input's gradient arrives, a ZeRO module's when its
    reduce-scatter starts), so another scope's entry is never the one taken."""
    entries, entry = _SCOPE.entries, _shapes(shapes)
    for i in range(len(entries) - 1, -1, -1):
        if entries[i] == entry:
            del entries[i]
            _rekey(_SCOPE.__dict__)
            return


def in_named() -> bool:
    return bool(_SCOPE.entries)


def excused(shape: tuple) -> bool:
    """Whether a Partial output of `shape` is the scope's to reduce (not charged to the op making it)."""
    return any(e is None or shape in e for e in _SCOPE.entries)


def scope_key() -> tuple:
    """What of the open scopes a decision depends on (empty outside every scope)."""
    return _SCOPE.key


def enter_named_here(shapes: Optional[Iterable] = None) -> Callable[[], None]:
    """Enter the scope on this thread (as `enter_named`); returns the matching leave, which leaves this thread's
    scope from whichever thread calls it (autograd runs a backward's final callbacks on the thread that called
    `backward()`, a CUDA backward's nodes on the device's own thread)."""
    entry = _shapes(shapes)
    mine = _SCOPE.__dict__  # this thread's attributes of the thread-local
    mine["entries"].append(entry)
    _rekey(mine)

    def leave() -> None:
        entries = mine["entries"]
        for i in range(len(entries) - 1, -1, -1):
            if entries[i] is entry:
                del entries[i]
                break
        _rekey(mine)
    return leave
