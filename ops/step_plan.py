"""A step plan: the layouts of a whole step chosen together, not one op at a time.

Op by op, a decision sees only its own bill (its inputs' boxing, what its
outputs still owe). It cannot see that the layout it picks for an output makes
the next op's choice dear: a flat MoE layer's combine all-to-alls an expert
output that its next matmul all-gathers; AdamW with fewer rows than ranks
reduces the gradient into the layout cheapest for `lerp_` alone and pays an
all-to-all in every later state update. A step plan sees the whole step:

1. The first run (recording) decides op by op as usual, and writes down each
   call: its valid choices (`ops/decide.py:options`), which values it reads
   (made by which earlier call, or laid out by the user) and which it makes.
2. On leaving it, `ops/step_solve.py` picks one choice per call so that the
   whole step's bill is least: every value's conversions to what its readers
   want, the kernels' own sends, what is left owing at the end.
3. Later runs take, at their k-th call, the k-th call's chosen choice (the
   dispatcher caches it like any decision). A call that differs from the
   recorded one (another op, or the choice no longer valid for its shapes)
   ends the steering for the rest of that run, and the next run records
   again: control flow that changes is followed, never forced.

A plan steers the thread that opened it: one simulated rank, or one process.
Every rank records and solves the same program, so they take the same choices.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..layout import Layout
from ..runtime.topology import TICK
from .decide import NOTHING, Decision, conversion_cost, flatten_out, kernel_bill, summed
from .program import ADOPTED
from .registry import RULES
from .scope import excused
from .step_solve import Graph, Read, solve


class _Active(threading.local):
    plan: Optional["StepPlan"] = None


ACTIVE = _Active()


@dataclass
class _Recording:
    graph: Graph = field(default_factory=Graph)
    tags: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # tensor -> value id
    nodes: dict = field(default_factory=dict)  # id(autograd node) -> (node, group number): held while recording


class StepPlan:
    """`with plan:` around a step (forward, backward, optimizer): see the module docstring.

    `plan.steering`: whether the last run followed the solved choices to its end (while one is open:
    whether it follows them so far); `plan.steered_runs` counts the runs that did.
    `plan.solved_cost` and `plan.recorded_cost`: the step's bill (the busiest rank's receive seconds, each
    rank's summed over the step; all ranks' seconds; collectives: `runtime/topology.py`'s link model, so on
    one node its bytes times one beta) under the solved and op-by-op choices.
    """

    def __init__(self) -> None:
        self.choices: Optional[list] = None       # per call: (func, (targets, out_layouts) or None, calls inside)
        self.graph: Optional[Graph] = None         # the last recorded step
        self.recorded_cost: Optional[tuple] = None
        self.solved_cost: Optional[tuple] = None
        self.steering = False
        self.runs = 0
        self.steered_runs = 0                      # runs that followed the solved choices to their end
        self._rec: Optional[_Recording] = None
        self._k = 0
        self._open: list = []                      # per call running now: where its recorded calls end
        self._outer: Optional[StepPlan] = None
        self._hook: Any = None                     # the optimizer's step hook (`step_plan(optimizer)`)
        self._stateless = False                    # the optimizer had no state when this run began

    # -- the context ------------------------------------------------------------------------------------
    def __enter__(self) -> "StepPlan":
        if ACTIVE.plan is self:
            raise RuntimeError("this step plan is already open: a plan covers one step at a time")
        self._outer, ACTIVE.plan = ACTIVE.plan, self
        self._k, self._open = 0, []
        if self.choices is None:
            self._rec = _Recording()
            self.steering = False
        else:
            self.steering = True
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        ACTIVE.plan, self._outer = self._outer, None
        self.runs += 1
        rec, self._rec = self._rec, None
        if kind is not None:
            return
        if rec is not None:
            chosen, recorded, solved = solve(rec.graph)
            self.recorded_cost, self.solved_cost = _seconds(recorded), _seconds(solved)
            self.graph = rec.graph
            self.choices = [(c.func, c.cands[i] if c.steer else None, c.span)
                            for c, i in zip(rec.graph.calls, chosen)]
        elif not self.steering or self._k != len(self.choices):  # the run went elsewhere: record the next
            self.choices = None
            self.steering = False
        else:
            self.steered_runs += 1

    def changes(self) -> list:
        """The calls whose solved choice differs from op by op's: (call number, op, op-by-op choice,
        solved choice), each choice as (input SBPs, output SBPs)."""
        g = self.graph
        if g is None or self.choices is None:
            return []
        out = []
        for k, (c, (_, solved, _)) in enumerate(zip(g.calls, self.choices)):
            if solved is not None and c.cands[c.chosen] != solved:
                out.append((k, c.func, _sbps(c.cands[c.chosen]), _sbps(solved)))
        return out

    def __repr__(self) -> str:
        if self.graph is None:
            return "StepPlan(not recorded yet)"
        lines = [f"StepPlan: {len(self.graph.calls)} calls; bill (busiest rank's receive seconds over the step, all "
                 f"ranks', collectives): op by op {_shown(self.recorded_cost)}, solved {_shown(self.solved_cost)}; "
                 f"{'steering' if self.steering else 'not steering'}"]
        for k, func, before, after in self.changes():
            lines.append(f"  call {k} {func}: {before[0]} -> {before[1]}  became  {after[0]} -> {after[1]}")
        return "\n".join(lines)

    def _next_run(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step ended one run: the next begins (`step_plan(optimizer)`). A recording of the step
        in which the optimizer made its state (AdamW's first: its moments' zeros) is not solved: no later
        step repeats those calls, so the next would only part from it; the next step records instead."""
        if ACTIVE.plan is self:
            if self._rec is not None and self._stateless and optimizer.state:
                self._rec = None
            self.__exit__(None, None, None)
        self._stateless = not optimizer.state
        self.__enter__()

    def close(self) -> None:
        """Stop following the optimizer's steps (`step_plan(optimizer)`): the run opened by the last step
        is dropped unjudged (it may have made no call yet); the solved choices stay for `with plan:`."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if ACTIVE.plan is self:
            ACTIVE.plan, self._outer = self._outer, None
            self._rec = None

    @property
    def recording(self) -> bool:
        return self._rec is not None

    # -- steering ---------------------------------------------------------------------------------------
    def enter(self, func: Any) -> tuple[Optional[tuple], Any]:
        """(the solved (targets, out_layouts) for the call now starting, or None: decide it as usual;
        a token for `leave` when it ends).

        Calls are matched by position, a decomposition's own calls nested in it. Where a layout makes
        an op decompose in one run and not in the other (a softmax over a dim one layout splits), the
        calls inside are skipped or left undecided, so the calls after it still match."""
        if not self.steering:
            return None, None
        k = self._k
        if k >= (self._open[-1] if self._open else len(self.choices)):  # inside a call the recording ran whole
            self._open.append(k)
            return None, k
        func_was, choice, span = self.choices[k]
        if func_was is not func:
            self.lost()
            return None, None
        self._k = k + 1
        end = k + 1 + span
        self._open.append(end)
        return choice, end

    def leave(self, token: Any) -> None:
        if token is not None and self.steering:
            self._open.pop()
            self._k = token

    def lost(self) -> None:
        """This run's calls no longer follow the recorded ones: decide op by op; record at the next run."""
        self.steering = False

    # -- recording --------------------------------------------------------------------------------------
    def begin_call(self, func: Any) -> int:
        """The number of the call now starting (a decomposition's own calls come after it)."""
        return self._rec.graph.add_call(func)

    def end_call(self, k: int) -> None:
        """Call k has returned: the calls after it up to now ran inside it (a decomposition)."""
        g = self._rec.graph
        g.calls[k].span = len(g.calls) - k - 1

    def record(self, k: int, func: Any, tensors: list, opts: Optional[tuple], dec: Decision, out: Any,
               cls: type) -> None:
        """Call `k` ran with decision `dec`; `opts` are its valid choices (None: nothing to choose)."""
        rec = self._rec
        g = rec.graph
        if dec.kind == "decompose":  # its own calls read and made the values
            return
        outs, _ = flatten_out(out)
        if dec.inplace and len(tensors) > 1 and outs and ADOPTED.pop(outs[0], None) is tensors[1]:
            # a fresh target took its source whole, in the source's layout, converting nothing (autograd's
            # `new_empty_strided(..).copy_(grad)` of a gradient whose strides are not its parameter's): the
            # target holds the source's value, in whatever layout the source's maker is steered to
            # (the fresh target's own values are never read: the call reads nothing)
            v = self._value_of(tensors[1], dec.sources[1], cls)
            g.set_call(k, [(dec.targets, (None,) * len(outs))], 0, [NOTHING], [], [None] * len(outs), steer=False)
            rec.tags[outs[0]] = v
            return
        if opts is None:  # nothing to choose; the outputs' layouts are what the run gave them
            made_in = tuple(o._layout if isinstance(o, cls) else None for o in outs)
            srcs, cands, chosen, bills = dec.sources, [(dec.targets, made_in)], 0, [NOTHING]
        else:
            ctx, srcs, cands = opts
            mine = (dec.targets, dec.out_layouts)
            if mine not in cands:
                cands = cands + [mine]
            chosen = cands.index(mine)
            bills = [_own_bill(ctx, srcs, c, dec) for c in cands]
        group = self._group()
        reads = []
        for slot, t in enumerate(tensors):
            v = self._value_of(t, srcs[slot], cls)
            reads.append(Read(v, slot, group))
        made = []
        for j, o in enumerate(outs):
            if o is None or not isinstance(o, cls):
                made.append(None)
                continue
            if dec.inplace and j == 0:  # the target, written: a new value in its own (fixed) layout
                v = g.add_value(tuple(o.shape), o.dtype, fixed=o._layout)
            else:
                v = g.add_value(tuple(o.shape), o.dtype, producer=(k, j), owes=not excused(tuple(o.shape)))
            rec.tags[o] = v
            made.append(v)
        g.set_call(k, cands, chosen, bills, reads, made, steer=opts is not None)

    def _value_of(self, t: Any, layout: Layout, cls: type) -> int:
        rec = self._rec
        v = rec.tags.get(t) if isinstance(t, torch.Tensor) else None
        if v is None:  # laid out by the user (a parameter, an input) or plain: fixed
            v = rec.graph.add_value(tuple(t.shape), t.dtype, fixed=layout)
            if isinstance(t, cls):
                rec.tags[t] = v
        return v

    def _group(self) -> Any:
        """Reads converted once together: one autograd node's in the backward (`ops/inputs.py`)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        held = self._rec.nodes.get(id(node))
        if held is None or held[0] is not node:
            held = self._rec.nodes[id(node)] = (node, len(self._rec.nodes))
        return held[1]


def _sbps(choice: tuple) -> tuple:
    targets, outs = choice
    return (tuple(t.sbp for t in targets), tuple(None if o is None else o.sbp for o in outs))


def note_conversion(t: Any, dst: Layout) -> None:
    """A GlobalTensor converted outside the dispatcher (`to_global`): a read the step plan weighs."""
    plan = ACTIVE.plan
    if plan is not None and plan._rec is not None:
        v = plan._rec.tags.get(t)
        if v is not None:
            plan._rec.graph.read_outside(v, dst)


def _seconds(score: tuple) -> tuple:
    """A solver's score (ticks, ticks, collectives) in seconds."""
    return (score[0] * TICK, score[1] * TICK, score[2])


def _shown(cost: Optional[tuple]) -> str:
    return "None" if cost is None else f"({cost[0]:.4g}, {cost[1]:.4g}, {cost[2]})"


def _own_bill(ctx: Any, srcs: tuple, choice: tuple, dec: Decision) -> Optional[tuple]:
    """What a choice costs besides its inputs' conversions: the kernel's own sends, an in-place result's
    conversion back into its target. None: impossible."""
    targets, out_layouts = choice
    bills = []
    rule = RULES.get(ctx.func)
    if rule is not None and rule.kernel_cost is not None:
        bills.append(kernel_bill(rule.kernel_cost(ctx, srcs, targets, out_layouts)))
    if dec.inplace:
        bills.append(conversion_cost(out_layouts[0], srcs[0], ctx.out_shapes[0], dec.out_dtypes[0]))
    if any(b is None for b in bills):
        return None
    return summed(bills)


def step_plan(optimizer: Optional[torch.optim.Optimizer] = None) -> StepPlan:
    """A plan for one step's layouts, chosen together (see `ops/step_plan.py`). Use it as `with plan:`
    around each step; the first run records, later runs follow.

    With `optimizer`, the optimizer's steps mark the steps instead: the plan is open from now on, and
    each `optimizer.step()` ends one run and begins the next, so a training loop needs no other
    change. `plan.close()` ends it (the hook is removed)."""
    plan = StepPlan()
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"step_plan(optimizer): expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        plan._hook = optimizer.register_step_post_hook(lambda opt, *_: plan._next_run(opt))
        plan._stateless = not optimizer.state
        plan.__enter__()
    return plan


__all__ = ["ACTIVE", "StepPlan", "step_plan", "note_conversion"]
