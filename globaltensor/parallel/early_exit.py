"""Early exit: a rank leaves a micro-batch's forward once nothing in the rest of it is its own.

Every rank runs a pipeline's whole global program; a rank outside a stage makes that stage's output
empty (`stage.StageForward`), which still costs a call per stage module, the glue between them, the
loss's and the hooks' Python. After a rank has sent its last activation the rest of the forward is
all such calls: on the first stage of four, three quarters of the model. So the pipeline learns, from
two steps that agree, at which stage call of each micro-batch's forward a rank has nothing left: every
call from there on is outside it, and no communication of its comes after (a tied weight's gather
moves it to the last stage from the first stage's rank, so that rank stays until the gather is done).
From the next step on the rank leaves there (`LeftForward`): the micro-batch's backward starts from the
tensors the skipped calls took, with the empty gradients the ranks inside give them (what the skipped
`_Elsewhere` nodes would have handed back), and the skipped stages' parameters take the empty gradients
they took at the last step's end.

A rank leaves only at a call where nothing that already ran waits on the rest: no forward hook of the
module, no gathering module or named scope open around it (their forward hooks close what they
opened). A forward that comes to the learnt call with another stage or after another number of
communications runs on to its end, and the pipeline learns again. What it cannot see is a program that
changes after the point it learnt: a communication added there, of a data-dependent program, waits on a
rank that left; the collective error that ends the step names the opt-out, `leave_early=False`.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional

import torch

from ..ops.scope import in_named
from ..runtime.comm import communications
from ..tensor import GlobalTensor
from .zero import gathering


class LeftForward(BaseException):
    """Raised by the stage call where this rank leaves a micro-batch's forward (a BaseException: a model's
    `except Exception` does not take it). `roots`: the tensors that call took and that take a gradient;
    `grads`: the empty gradients the ranks inside give them."""

    def __init__(self, targets: list, layouts: tuple) -> None:
        super().__init__("a rank left a micro-batch's forward (caught by gt.Pipeline)")
        kept = [(t, g) for t, g in zip(targets, layouts) if g is not None]
        self.roots = [t for t, _ in kept]
        self.grads = [GlobalTensor(torch.empty((0,), dtype=g[2], device=t._local.device), g[0], g[1])
                      for t, g in kept]


class Note(NamedTuple):
    """A stage call of a learning forward, as `leave_point` reads it."""
    stage: Any      # its stage forward
    sent: int       # this rank's communications in the forward before it
    inside: bool    # whether this rank is in the stage
    may: bool       # whether the forward may be left there (`may_leave`)


class ExitPoint(NamedTuple):
    """Where a learnt forward is left (`leave_point`; `begin` arms it)."""
    at: int         # the index of the stage call to leave at
    expect: tuple   # the (stage forward, communications before it) the learning saw there
    later: tuple    # the stage forwards the rest of the forward calls


class _Calls(threading.local):
    """This thread's micro-batch forward (a pipeline fiber's, or the rank's), as its stage calls see it."""
    on = False
    notes: Optional[list] = None  # learning: a Note per stage call
    leave: Optional[ExitPoint] = None  # armed
    n = 0                         # stage calls so far
    start = 0                     # communications when the forward began
    missed = False                # the call at `leave_at` was not the learnt one: the forward ran on


CALLS = _Calls()


def begin(leave: Any) -> None:
    """A micro-batch's forward starts on this thread: `leave` (from `leave_point`) arms the exit; None notes the
    stage calls instead (learning); False neither (a learnt forward with no exit)."""
    c = CALLS
    c.on, c.n, c.start, c.missed = True, 0, communications(), False
    if leave is None:
        c.notes, c.leave = [], None
    elif leave is False:
        c.notes, c.leave = None, None
    else:
        c.notes, c.leave = None, leave


def end() -> tuple[Optional[tuple], bool]:
    """The forward is over: (its notes and how many communications it made, or None if armed; whether the
    armed exit missed)."""
    c = CALLS
    noted = (tuple(c.notes), communications() - c.start) if c.notes is not None else None
    missed = c.missed
    c.on, c.notes, c.leave = False, None, None
    return noted, missed


def note(stage: Any, inside: bool) -> bool:
    """A stage call begins (`StageForward.__call__`); True where this rank leaves the forward here (the caller
    raises `LeftForward` with the call's gradient targets)."""
    c = CALLS
    k = c.n
    c.n = k + 1
    sent = communications() - c.start
    if c.notes is not None:
        c.notes.append(Note(stage, sent, inside, not inside and may_leave(stage.module)))
        return False
    leave = c.leave
    if leave is None or k != leave.at:
        return False
    if leave.expect == (stage, sent) and may_leave(stage.module):
        for f in leave.later:  # the skipped calls' parameters: their empty gradients, as at the last step's end
            f.give_empty_grads_as_before()
        return True
    c.missed = True
    return False


def untouched() -> bool:
    """Whether nothing in this micro-batch's forward so far is this rank's: no communication of its yet. What an
    outside stage call takes then has no history here (anything this rank computed reaches another placement
    only through a message it sends), so its backward would hand empty gradients to nothing: the stage's
    output need not connect to it (a rank's backward ends where its first stage began, not at the
    embeddings)."""
    c = CALLS
    return c.on and communications() == c.start


def missed() -> None:
    """The armed call could not leave after all (it has never shown its output's layout): the forward runs on."""
    CALLS.missed = True


def may_leave(module: torch.nn.Module) -> bool:
    """Whether the forward may end at a call of `module` on a rank outside it: nothing already begun waits on
    the rest (no forward hook of the module's; its pre-hooks, a pipeline's own aside, would have run alone;
    no gathering module nor named scope open around it) and the forward records a backward."""
    hooks = torch.nn.modules.module
    return (torch.is_grad_enabled() and not gathering() and not in_named() and not module._forward_hooks
            and len(module._forward_pre_hooks) == len(module.__dict__.get("_gt_stage_hooks", ()))
            and not hooks._global_forward_hooks and not hooks._global_forward_pre_hooks)


def leave_point(notes: tuple, total: int) -> Optional[ExitPoint]:
    """Where a learnt forward may be left, from its `Note`s and its communications in all: the first stage call
    from which on every call is outside this rank and no communication of its follows, at which it may leave
    (`begin`'s `leave`). None: nowhere."""
    if not total:  # nothing of this rank's crossed (a rank in no stage): its backward ends at once (`untouched`)
        return None
    best = None
    for j in range(len(notes) - 1, -1, -1):
        stage, sent, inside, may = notes[j]
        if inside or sent != total:
            break
        if may:
            best = j
    if best is None:
        return None
    return ExitPoint(best, notes[best][:2], tuple(dict.fromkeys(n[0] for n in notes[best:])))
