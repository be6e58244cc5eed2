"""Choosing every call's signature of a recorded step at once (the solver of `ops/step_plan.py`).

The step is a graph: calls, each with its valid choices, and values, each
made by one call (its layout then depends on that call's choice) or laid out
by the user (fixed), and read by later calls (each read wants the layout its
reader's choice names). The bill of a choice of every call:

- per value, its conversions to what its readers want: a Partial value is
  reduced once per target layout (`ops/inputs.py` remembers the reduction),
  any other once per reading call, or once per autograd node in the backward
  (as `ops/inputs.py` converts it);
- per value that nobody reads and that is still Partial, its cheapest
  reduction (what it owes, as op-by-op decisions charge it);
- per call, what its kernel sends itself and an in-place result's conversion
  back into its target.

Each bill is the time every global rank's receives take (its bytes times the
beta of the link they cross, `decide.Bill.ticks`: on one node, its bytes
times one beta), and collectives; they are summed rank by rank over the step
(`Cost`), and the step is scored by (its busiest rank's receive time, all
ranks', collectives), compared in that order: the rank the step waits on.
Not by the sum of each conversion's busiest rank: with uneven shards the busiest rank differs between conversions, and a choice
that lowers that sum can raise the step's busiest rank (test_step_plan.py's
example: 568 -> 544 bytes in all, 176 -> 192 on rank 2).

The search starts from the op-by-op choices and improves them by local
moves until none helps: one call's choice at a time given the others, then
a call with the calls around it following (a layout change that pays only
when both ends move: the MoE combine). It is a local search, not an exact
one. The score is a maximum of sums, not a sum of per-call parts, so no move
is weighed alone: the search keeps the step's per-rank bill under its
current choices and scores a trial as that bill less what the calls it moves
cost before plus what they cost after (exact for the whole step, at one
per-rank vector per trial). A move is kept only if the step's score falls,
so the search never ends worse than op by op in this bill, and every choice
it can take is one the rule's kernel accepts. What it can miss is what any
local search misses: a better choice reached only through dearer ones,
beyond what one wave moves.

Known gap of the bill: the calls inside a decomposition are charged as
recorded under every choice, though a steered run whose layouts let the op
run whole skips them (a softmax over a dim the recording split): the bill
then overstates such a choice (test_step_plan.py's program, mesh (3,),
[5, 1] @ [1, 3]: solved bill [144, 144, 176] B per rank, the steered run
receives [48, 48, 48]), so the search may pass over it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..layout import Layout
from .decide import NOTHING, Bill, conversion_cost, owed_by

INF = (float("inf"), 0, 0)    # an impossible choice's score
MAX_SWEEPS = 20
WAVE_LIMIT = 64         # calls a trial choice may move after it
WORK_LIMIT = 4_000_000  # value costs weighed before the search stops improving (its choices stay valid).
# A count, not a clock: every rank solves the same graph on its own and must stop at the same point.


@dataclass(frozen=True)
class Read:
    value: int
    slot: int
    group: Any          # the autograd node reading it (backward), or None


@dataclass
class Call:
    func: Any
    cands: list = field(default_factory=list)   # [(targets, out_layouts)]
    chosen: int = 0
    bills: list = field(default_factory=list)   # per choice: (bytes per rank, collectives) or None
    reads: list = field(default_factory=list)   # [Read]
    made: list = field(default_factory=list)    # per output: value id or None
    steer: bool = False                         # a kernel decision: the plan may choose for it
    span: int = 0                               # calls made inside it (a decomposition's)


@dataclass
class Value:
    shape: tuple
    dtype: torch.dtype
    fixed: Optional[Layout] = None
    producer: Optional[tuple] = None            # (call, output index)
    owes: bool = True                           # unread and Partial at the end: charged its reduction
    readers: list = field(default_factory=list)  # [(call, Read)]
    outside: list = field(default_factory=list)  # layouts it was converted to by `to_global` (not a call)


class Graph:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.values: list[Value] = []

    def add_call(self, func: Any) -> int:
        self.calls.append(Call(func))
        return len(self.calls) - 1

    def add_value(self, shape: tuple, dtype: torch.dtype, fixed: Optional[Layout] = None,
                  producer: Optional[tuple] = None, owes: bool = True) -> int:
        self.values.append(Value(shape, dtype, fixed, producer, owes))
        return len(self.values) - 1

    def read_outside(self, v: int, dst: Layout) -> None:
        """Value v converted explicitly (`x.to_global(...)`, a gradient's conversion back): a read
        with a fixed target, which no choice here changes but the value's own layout makes dear."""
        self.values[v].outside.append(dst)

    def set_call(self, k: int, cands: list, chosen: int, bills: list, reads: list, made: list,
                 steer: bool) -> None:
        c = self.calls[k]
        c.cands, c.chosen, c.bills, c.reads, c.made, c.steer = cands, chosen, bills, reads, made, steer
        for r in reads:
            self.values[r.value].readers.append((k, r))


def _term(bill: Optional[Bill], world: int) -> tuple:
    """A bill (`decide.Bill`), or None (impossible), as (the receive time of each of the `world` global
    ranks, collectives, impossible): what `Cost.add` sums. A bill's vector stops at the highest rank it
    names; the term runs to the step's highest rank, so that every term has one length."""
    if bill is None:
        return (0,) * world, 0, 1
    vec = bill.ticks
    return tuple(vec) + (0,) * (world - len(vec)), bill.collectives, 0


class Cost:
    """Bills summed rank by rank: bytes each of the `world` global ranks receives, collectives, and how
    many of the bills are impossible. `score`: (the busiest rank's bytes, all ranks' bytes, collectives)."""

    __slots__ = ("vec", "n", "bad")

    def __init__(self, world: int) -> None:
        self.vec: list = [0] * world
        self.n = 0
        self.bad = 0

    def add(self, term: tuple, sign: int = 1) -> None:
        vec, n, bad = term
        self.vec = list(map(operator.add if sign > 0 else operator.sub, self.vec, vec))
        self.n += sign * n
        self.bad += sign * bad

    def plus(self, other: "Cost", sign: int = 1) -> None:
        self.add((other.vec, other.n, other.bad), sign)

    def copy(self) -> "Cost":
        c = Cost(0)
        c.vec, c.n, c.bad = list(self.vec), self.n, self.bad
        return c

    def score(self) -> tuple:
        if self.bad:
            return INF
        return (max(self.vec, default=0), sum(self.vec), self.n)

    def is_zero(self) -> bool:
        return self.n == 0 and self.bad == 0 and not any(self.vec)


class _Search:
    """The search's state: a choice per call, and the step's bill under it (`step`), kept up to date as
    choices change (`_set`): a trial is scored as the step less what the calls it moves cost before plus
    what they cost after, since the busiest rank of the step is no sum of per-call parts. Layouts are
    numbered once, so that comparing and looking up conversions is integer work (the search weighs each
    value's readers many times)."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.choice = [c.chosen for c in g.calls]
        ids: dict = {}
        self.layouts: list = []

        def num(lay: Optional[Layout]) -> int:
            if lay is None:
                return -1
            i = ids.get(lay)
            if i is None:
                i = ids[lay] = len(self.layouts)
                self.layouts.append(lay)
            return i
        self.targets = [[tuple(num(t) for t in ts) for ts, _ in c.cands] for c in g.calls]
        self.outs = [[tuple(num(o) for o in os) for _, os in c.cands] for c in g.calls]
        self.fixed = [num(v.fixed) for v in g.values]
        # per value: its readers as (call, slot, group key for the non-Partial dedupe); a conversion
        # outside the calls as (-1, its target layout's number, its own key)
        self.readers = [[(k, r.slot, ("call", k) if r.group is None else ("node", r.group)) for k, r in v.readers]
                        + [(-1, num(lay), ("outside", i)) for i, lay in enumerate(v.outside)]
                        for v in g.values]
        self.partial = [lay.has_partial for lay in self.layouts]
        # every bill as a vector over the ranks up to the highest any layout or call's bill names
        self.world = max([max(lay.placement.flat_ranks) + 1 for lay in self.layouts]
                         + [len(b[0]) for c in g.calls for b in c.bills if b is not None] + [0])
        nothing = _term(NOTHING, self.world)  # a decomposition's own bill
        self.own = [[_term(b, self.world) for b in c.bills] or [nothing] for c in g.calls]
        self._bills: dict = {}
        self.work = 0
        self.step = self.total()

    def _source(self, v: int) -> int:
        p = self.g.values[v].producer
        if p is None:
            return self.fixed[v]
        return self.outs[p[0]][self.choice[p[0]]][p[1]]

    def _bill(self, v: int, src: int, dst: int) -> tuple:
        """Converting value v from layout src to dst (dst -1: what it owes unread), as a `Cost` term."""
        val = self.g.values[v]
        key = (src, dst, val.shape, val.dtype)
        got = self._bills.get(key)
        if got is None:
            lay = self.layouts[src]
            got = self._bills[key] = _term(owed_by(lay, val.shape, val.dtype) if dst < 0 else
                                           conversion_cost(lay, self.layouts[dst], val.shape, val.dtype),
                                           self.world)
        return got

    def value_cost(self, v: int, into: Cost) -> None:
        """Adds value v's conversions (or what it owes unread) to `into`."""
        self.work += 1
        src = self._source(v)
        if src < 0:
            return
        readers = self.readers[v]
        partial = self.partial[src]
        if not readers:
            if partial and self.g.values[v].owes:
                into.add(self._bill(v, src, -1))
            return
        seen: set = set()
        choice, targets = self.choice, self.targets
        for k, slot, group in readers:
            dst = targets[k][choice[k]][slot] if k >= 0 else slot
            if dst == src:
                continue
            once = dst if partial else (group, dst)
            if once in seen:
                continue
            seen.add(once)
            into.add(self._bill(v, src, dst))

    def touched(self, calls: tuple) -> set:
        vs: set = set()
        for k in calls:
            c = self.g.calls[k]
            vs.update(r.value for r in c.reads)
            vs.update(v for v in c.made if v is not None)
        return vs

    def local(self, calls: tuple, values: set) -> Cost:
        total = Cost(self.world)
        for k in calls:
            total.add(self.own[k][self.choice[k]])
        for v in values:
            self.value_cost(v, total)
        return total

    def total(self) -> Cost:
        return self.local(tuple(range(len(self.g.calls))), set(range(len(self.g.values))))

    def trial(self, before: Cost, after: Cost) -> tuple:
        """The step's score if the part that costs `before` now costs `after`."""
        t = self.step.copy()
        t.plus(before, -1)
        t.plus(after)
        return t.score()

    def _set(self, k: int, c: int) -> None:
        """Call k takes choice c; the step's bill follows."""
        if c == self.choice[k]:
            return
        values = self.touched((k,))
        before = self.local((k,), values)
        self.choice[k] = c
        self.step.plus(before, -1)
        self.step.plus(self.local((k,), values))

    def improve_one(self, k: int) -> bool:
        values = self.touched((k,))
        start = self.choice[k]
        before = self.local((k,), values)
        best, best_score = start, self.step.score()
        for c in range(len(self.g.calls[k].cands)):
            if c == start:
                continue
            self.choice[k] = c
            score = self.trial(before, self.local((k,), values))
            if score < best_score:
                best, best_score = c, score
        self.choice[k] = start
        self._set(k, best)
        return best != start

    def paying(self, k: int) -> bool:
        """Whether call k's choice or a value it touches costs something (only there can a move help)."""
        return not self.local((k,), self.touched((k,))).is_zero()

    def followers(self, k: int) -> list:
        """Calls whose best choice may follow k's, each with how it follows: the readers of what k makes
        and the other readers of what k reads follow by their inputs ("down": a Partial value read in
        one layout by all of them is reduced once), the makers of what k reads by everything they
        touch ("up": they make what k now wants)."""
        g, out = self.g, {}
        c = g.calls[k]
        for v in [r.value for r in c.reads] + [v for v in c.made if v is not None]:
            for j, _ in g.values[v].readers:
                out[j] = "down"
        for r in c.reads:
            p = g.values[r.value].producer
            if p is not None:
                out.setdefault(p[0], "up")
        out.pop(k, None)
        return sorted((j, how) for j, how in out.items() if g.calls[j].steer and len(g.calls[j].cands) > 1)

    def follow(self, j: int) -> bool:
        """Call j re-chooses by its inputs alone (its own bill and what its reads cost, with the rest of
        the step as it is), as if what reads its outputs will follow it in turn."""
        reads = {r.value for r in self.g.calls[j].reads}
        start = self.choice[j]
        before = self.local((j,), reads)
        best, best_score = start, None
        for c in range(len(self.g.calls[j].cands)):
            self.choice[j] = c
            score = self.trial(before, self.local((j,), reads))
            if best_score is None or score < best_score:
                best, best_score = c, score
        self.choice[j] = start
        self._set(j, best)
        return best != start

    def improve_wave(self, k: int) -> bool:
        """Try each other choice of k, and let the calls around it follow (`followers`) as far as they
        change, like an SBP inferred forward and backward; keep the best outcome if the step costs less.

        A layout change often pays only once the views and pointwise ops after it follow it (eight calls
        in a MoE combine's backward): one call at a time, each step of the way is dearer."""
        start, start_step = list(self.choice), self.step.copy()
        best_score, best = start_step.score(), None
        for c in range(len(self.g.calls[k].cands)):
            if c == start[k]:
                continue
            self._set(k, c)
            moved, queue = {k}, self.followers(k)
            while queue and len(moved) < WAVE_LIMIT:
                j, how = queue.pop(0)
                if j not in moved and (self.follow(j) if how == "down" else self.improve_one(j)):
                    moved.add(j)
                    queue += self.followers(j)
            score = self.step.score()
            if score < best_score:
                best_score, best = score, (list(self.choice), self.step.copy())
            self.choice, self.step = list(start), start_step.copy()
        if best is not None:
            self.choice, self.step = best
        return best is not None


def solve(g: Graph) -> tuple[list, tuple, tuple]:
    """(chosen choice per call, the op-by-op bill, the solved bill)."""
    s = _Search(g)
    before = s.step.score()
    free = [k for k, c in enumerate(g.calls) if c.steer and len(c.cands) > 1]
    for _ in range(MAX_SWEEPS):
        changed = False
        for k in free:
            changed |= s.improve_one(k)
        for k in free:
            if s.paying(k):
                changed |= s.improve_wave(k)
            if s.work > WORK_LIMIT:
                break
        if not changed or s.work > WORK_LIMIT:
            break
    return s.choice, before, s.step.score()


__all__ = ["Graph", "Read", "Call", "Value", "solve"]
