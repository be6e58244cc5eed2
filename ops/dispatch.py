"""The one dispatcher: call key -> program (decided and compiled once) -> run.

It works on (local tensor, layout, global shape) triples; `globaltensor.tensor`
unwraps and wraps GlobalTensors around it (the class comes in as `cls`, so
this module never imports the front door). What a call's decision depends on
is its key (`ops/keys.py`); a decision (`ops/decide.py`) is compiled into the
program that runs it (`ops/program.py`), and a cache hit is one dictionary
look-up and that program. The cache is bounded: a loop whose shapes change
every step evicts its oldest entries instead of growing.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional

from ..runtime.topology import on_change
from ..runtime.trace import FLAGS as _TRACING, STATE as _TRACE_STATE, pop_op, push_op
from .decide import Decision, backward_key, decide, map_tensors, options
from .inputs import _CHECK, box, box_global, defer_reduction
from .keys import TensorKey, call_key, tensor_key
from .program import Program, compile_decomposition, compile_program
from .registry import RULES
from .scope import enter_named, leave_named, scope_key
from .stats import _WARNED, reset_stats, stats
from .step_plan import ACTIVE as _STEP

MAX_PROGRAMS = 16384
_PROGRAMS: dict[tuple, Program] = {}
_NO_KWARGS: dict = {}
_KEYING: dict = {}  # id(op) -> `_keying`'s tuple
_DECOMPOSITIONS: dict = {}  # (id(op), class) -> the program of an op whose rule always decomposes


def run(func: Any, args: tuple, kwargs: Optional[dict], cls: type) -> Any:
    """Entry point from GlobalTensor.__torch_dispatch__."""
    kwargs = kwargs or _NO_KWARGS
    if _TRACING.on:  # a gt.comm_report() is open: note the op, so its collectives can say which op needed them
        return _traced(func, args, kwargs, cls)
    if _STEP.plan is not None:
        return _planned(func, args, kwargs, cls)
    return _program_for(func, args, kwargs, cls)(args, kwargs)


def _traced(func: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    push_op(func, args)
    try:
        if _STEP.plan is not None:
            for watch in _TRACE_STATE.watchers:
                watch(func, args, kwargs, None)
            return _planned(func, args, kwargs, cls)
        program = _program_for(func, args, kwargs, cls)
        decision = getattr(program, "decision", None)  # a foreach decomposition has none
        then = [w for w in [watch(func, args, kwargs, decision) for watch in _TRACE_STATE.watchers] if w is not None]
        out = program(args, kwargs)
        for w in then:  # a watcher that asked for the op's output (a pipeline's replay recording)
            w(out)
        return out
    finally:
        pop_op()


def _keying(func: Any) -> tuple:
    """(its rule's scalar_key, whether floats key by value, whether it always decomposes)."""
    keying = _KEYING.get(id(func))  # by id: an OpOverload's __hash__ is a Python call, and ops live forever
    if keying is None:
        rule = RULES.get(func)
        keying = _KEYING[id(func)] = (None, True, False) if rule is None else (
            rule.scalar_key, False,
            rule.decompose is not None and rule.decompose_when is None and not rule.overwrites)
    return keying


def _key_of(func: Any, args: tuple, kwargs: dict, cls: type) -> tuple:
    scalar_key, floats_by_value, _ = _keying(func)
    return call_key(func, args, kwargs, cls, scalar_key, floats_by_value) + scope_key() + backward_key()


def _program_for(func: Any, args: tuple, kwargs: dict, cls: type) -> Program:
    scalar_key, floats_by_value, always_decomposes = _keying(func)
    if always_decomposes:  # nothing to decide: no key to build (a foreach op's walks every list element)
        program = _DECOMPOSITIONS.get((id(func), cls))
        if program is None:
            program = _DECOMPOSITIONS[(id(func), cls)] = compile_decomposition(func, RULES[func], cls)
        return program
    key = call_key(func, args, kwargs, cls, scalar_key, floats_by_value) + scope_key() + backward_key()
    program = _PROGRAMS.get(key)
    if program is None:
        program = _compile(key, func, args, kwargs, cls)
    return program


def _planned(func: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    """A call inside a step plan (`ops/step_plan.py`): recorded with its choices, or steered by the plan."""
    plan = _STEP.plan
    if plan.recording:
        k = plan.begin_call(func)
        key = _key_of(func, args, kwargs, cls)
        program = _PROGRAMS.get(key) or _compile(key, func, args, kwargs, cls)
        tensors = _tensors_of(args, kwargs)
        opts = _OPTIONS.get(key, _NONE)
        if opts is _NONE:
            if len(_OPTIONS) >= MAX_PROGRAMS:
                _OPTIONS.clear()
            opts = _OPTIONS[key] = options(func, args, kwargs, tensors, cls)
        out = program(args, kwargs)
        plan.end_call(k)
        plan.record(k, func, tensors, opts, program.decision, out, cls)  # type: ignore[attr-defined]
        return out
    forced, token = plan.enter(func)
    try:
        if forced is None:
            return _program_for(func, args, kwargs, cls)(args, kwargs)
        key = _key_of(func, args, kwargs, cls) + (_STEERED, forced)
        program = _PROGRAMS.get(key)
        if program is None:
            dec = decide(func, args, kwargs, _tensors_of(args, kwargs), cls, forced=forced)
            if dec is None:  # the recorded choice does not fit this call: op by op from here on
                plan.lost()
                return _program_for(func, args, kwargs, cls)(args, kwargs)
            program = _store(key, compile_program(func, dec, args, kwargs, cls))
        return program(args, kwargs)
    finally:
        plan.leave(token)


_NONE = object()
_STEERED = object()  # key mark: the rest of the key is the choice a step plan made for this call
_OPTIONS: dict = {}  # call key -> its valid choices (`decide.options`), for recording step plans


def _tensors_of(args: tuple, kwargs: dict) -> list:
    tensors: list = []
    map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    return tensors


def _compile(key: tuple, func: Any, args: tuple, kwargs: dict, cls: type) -> Program:
    return _store(key, compile_program(func, decide(func, args, kwargs, _tensors_of(args, kwargs), cls),
                                       args, kwargs, cls))


def _store(key: tuple, program: Program) -> Program:
    if len(_PROGRAMS) >= MAX_PROGRAMS:  # drop the oldest quarter (insertion order)
        for old in list(itertools.islice(_PROGRAMS, MAX_PROGRAMS // 4)):
            del _PROGRAMS[old]
    _PROGRAMS[key] = program
    return program


def decision_of(func: Any, args: tuple, kwargs: Optional[dict], cls: type) -> Optional[Decision]:
    """The decision the dispatcher takes for this call (cached, or made now): kind, targets, output layouts;
    None for an op whose rule always decomposes (nothing to decide). A call with ragged inputs gets its
    decision here, from the one cache, and is run by the ragged tensor's op path."""
    return getattr(_program_for(func, args, kwargs or _NO_KWARGS, cls), "decision", None)


def cache_size() -> int:
    return len(_PROGRAMS)


def check_replicated(enabled: bool = True) -> None:
    """Verify that plain tensors mixed with GlobalTensors are equal on every rank (GT_CHECK_REPLICATED=1)."""
    _CHECK["replicated"] = enabled
    clear_cache()


def clear_cache() -> None:
    _PROGRAMS.clear()
    _KEYING.clear()
    _DECOMPOSITIONS.clear()
    _OPTIONS.clear()


on_change(clear_cache)  # a decision cached under one link model is not the decision under another


__all__ = ["run", "decision_of", "cache_size", "check_replicated", "clear_cache", "stats", "reset_stats",
           "box", "box_global", "defer_reduction", "enter_named", "leave_named", "tensor_key", "TensorKey", "Decision", "_WARNED"]
