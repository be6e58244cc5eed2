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
from typing import Any, Callable, Iterable, Optional

import torch

from ..runtime import fiber
from ..sbp import Broadcast, Split


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


class _Sinks(threading.local):
    """The parameters the autograd node running on this thread accumulates gradients into (one node remembered:
    the node itself, not its id, which a later node may reuse)."""

    def __init__(self) -> None:
        self.node: object = None
        self.sinks: tuple = ()


_SINKS = _Sinks()


def grad_sinks() -> tuple:
    """((shape, dtype, layout), ...) of the GlobalTensor parameters whose gradients the running backward node
    hands to their accumulation (its next functions' `AccumulateGrad`): an output of that shape and dtype is
    that parameter's gradient, which the optimizer reads in the parameter's layout (`_defer_grad_reduction`
    converts it there), so what it owes is that conversion (`decide.owed`). Empty outside a backward, and inside a
    scope, whose plan decides (a named module's Partial outputs are its to reduce, a ZeRO module reduce-scatters
    its parameters' gradients)."""
    node = torch._C._current_autograd_node() if not _SCOPE.entries else None
    if node is None:  # outside a backward, or inside a scope: its plan (the named module's, ZeRO's) decides
        return ()
    if torch.compiler.is_compiling() or "Compiled" in node.name():
        return ()  # a compiled backward is one node over every parameter: shapes alone would name the wrong ones
    memo = _SINKS
    if memo.node is not node:
        found = []
        for fn, _ in node.next_functions:
            var = getattr(fn, "variable", None) if fn is not None else None
            layout = getattr(var, "_layout", None)
            # a strided or zigzag parameter's gradient is made on a permuted reading (as a plain split,
            # `ops/strided_split.py`), whose layout is not the parameter's: left as any other output
            if layout is not None and var.requires_grad and all(type(s) in (Broadcast, Split) for s in layout.sbp):
                found.append((tuple(var.shape), var.dtype, layout))
        memo.node, memo.sinks = node, tuple(found)
    return memo.sinks


def grad_sink(shape: tuple, dtype: torch.dtype) -> Optional[Any]:
    """The layout an output of `shape` and `dtype` is read in as a parameter's gradient, if the running backward
    node accumulates one such parameter (several of that shape in other layouts: None, no single reader)."""
    found = {lay for s, d, lay in grad_sinks() if s == shape and d == dtype}
    return next(iter(found)) if len(found) == 1 else None


def scope_key() -> tuple:
    """What of the open scopes a decision depends on (empty outside every scope), and the parameters the running
    backward node accumulates (`grad_sinks`)."""
    sinks = grad_sinks()
    return _SCOPE.key + (("sinks", sinks),) if sinks else _SCOPE.key


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
