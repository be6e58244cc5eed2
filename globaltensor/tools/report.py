"""`gt.comm_report()`: every collective of a region, with the module, op and reason that made it.

`gt.comm_log()` says what moved; a report also says why, so that a user can tell which line of
a model costs what (DTensor's `CommDebugMode` counts per module; JAX shows layouts). Each
collective is noted the moment the communicator records it, with the context the code around
it pushed (`runtime/trace.py`): the op being dispatched and which of its arguments was boxed
from what layout to what, the module whose boundary layout (`gt.ModuleLayout`) asked for a
conversion, a gradient bucket, a ZeRO gather or reduce-scatter. Forward, backward and what runs
outside any module (the optimizer step) are kept apart.

The module path comes from hooks the report installs on the modules it is given, and on every
module it discovers called at the top level (a global forward pre-hook, `torch.nn.modules.module.
register_module_forward_pre_hook`). Backward collectives run inside autograd nodes; when a
module's forward ends, the nodes it created (sequence numbers since its start) are tagged with
its path, so the backward of each node is attributed to the module that built it. Nothing of
this runs without an open report: the dispatcher tests one flag.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import torch

from ..parallel.trees import tensors
from ..runtime import context
from ..runtime.comm import CommEvent, CommLog
from ..runtime.trace import FLAGS, STATE
from ..tensor import GlobalTensor

_TAG = "gt_module"  # key in an autograd node's metadata: (module path, stage)
_OUTSIDE = "(outside modules)"


@dataclass(frozen=True)
class Collective:
    """One collective as this rank saw it, with what needed it."""
    module: str              # module path ("" is the root module), or "(outside modules)"
    phase: str               # "forward", "backward" or "outside" (not inside a module's forward or a backward)
    op: str                  # the aten op (or the autograd node, backward) that ran it; "" if none
    kind: str                # all_reduce, all_gather, reduce_scatter, all_to_all, send_recv, broadcast, ...
    axis: str                # the mesh axis ("0", "1"), "all" (the whole mesh) or the group's ranks
    group: tuple
    recv_bytes: int          # received by this rank (the byte convention of gt.comm_log)
    reason: str              # the argument and conversion, module hint, gradient bucket or ZeRO step
    lower_bound: Optional[int]  # what the conversion had to receive at least on this rank (None: unknown)
    start_ns: int            # wall-clock nanoseconds (time.time_ns scale), for the chrome trace
    end_ns: int


class _Frame:
    __slots__ = ("path", "stage", "seq", "module")

    def __init__(self, path: str, stage: str, seq: int, module: int) -> None:
        self.path, self.stage, self.seq = path, stage, [seq, seq, seq]  # starts of input, body, output
        self.module = module  # id of the module whose call this is


class CommReport(CommLog):
    """A `CommLog` whose events carry context; `str(report)` is the tree, `to_json()` the data."""

    def __init__(self, rank: int, world_size: int, names: dict) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.collectives: list[Collective] = []
        self._names = names                  # id(module) -> path
        self._placements: list = []          # placements seen, to name mesh axes
        self._clock = time.time_ns() - time.perf_counter_ns()

    # -- recording (called by the communicator, on this rank's thread) ----------------------
    def add(self, event: CommEvent) -> None:
        super().add(event)
        end = time.perf_counter_ns()
        start = getattr(STATE, "t0", None) or end  # set by the primitive's start (none for send_recv)
        STATE.t0 = None
        module, phase, op, reason, route = self._context(event)
        self.collectives.append(Collective(module, phase, op, event.kind, self._axis(event.group, route),
                                           event.group, event.recv_bytes, reason, _lower_bound(route, self.rank),
                                           start + self._clock, end + self._clock))

    def _context(self, event: CommEvent) -> tuple:
        """(module, phase, op, reason, route) of the collective being recorded.

        The most specific owner wins: a gradient bucket, then a ZeRO step (by the autograd node, or a
        bucket at a module's input), then a module boundary conversion with no op in progress, then
        the op and which of its arguments the route converts, then an op's own collective.
        """
        node = torch._C._current_autograd_node()
        stage = "body"
        if node is not None:
            phase = "backward"
            tag = node.metadata.get(_TAG)
            module, stage = tag if tag is not None else (_OUTSIDE, "body")
            node_name = node.name()
        elif STATE.frames:
            phase, frame = "forward", STATE.frames[-1]
            module, stage, node_name = frame.path, frame.stage, ""
        else:
            phase, module, node_name = "outside", _OUTSIDE, ""
        ops, routes = STATE.ops, STATE.routes
        route = routes[-1] if routes else None
        op = _op_name(ops[0][0]) if ops else ""
        inner = _op_name(ops[-1][0]) if ops else ""
        where = f"{op} (as {inner})" if inner != op else op
        if ops:
            self._note_placement(ops[-1][1])
        conv = _conversion(route)
        if STATE.why:
            reason = STATE.why[-1] + (f", first read by {where}" if op else "")
        elif node_name == "_GatherBackward":
            reason = f"ZeRO: {_name(module)}'s parameter gradients back to their stored layout{conv}"
        elif node_name == "_RegatherBackward":
            reason = f"ZeRO-3: {_name(module)}'s parameters gathered again for its backward{conv}"
        elif phase == "forward" and stage == "input" and not op and (
                isinstance(route, tuple) or route is None and event.kind == "all_gather"):
            # a bucket gathered in a module's pre-hook: ZeRO's, for this module or (prefetch) the next one
            reason = f"ZeRO: parameters gathered as {_name(module)} starts (its own, or the next module's " \
                     f"prefetched){conv}"
        elif route is not None and not op and stage in ("input", "output") and module != _OUTSIDE:
            which = stage if phase == "forward" else f"{stage}_grad"
            what = f"its {stage}'s gradient" if phase == "backward" else f"its {stage}"
            reason = f"ModuleLayout({which}) of {_name(module)}, {what}{conv}"
        elif route is not None and op:
            reason = f"{where}, {_argument(route, ops[-1][1])}{conv}"
        elif op:
            reason = f"{where}: the op's own {event.kind} (its rule reduces or exchanges inside)"
        elif route is not None:
            reason = f"to_global{conv}" if phase != "backward" else f"backward of to_global ({node_name}){conv}"
        else:
            reason = f"{event.kind} of metadata" if event.recv_bytes == 0 else event.kind
        if phase == "backward" and node_name and op:
            op = f"{node_name}: {op}"
        elif phase == "backward" and node_name:
            op = node_name
        return module, phase, op, reason, route

    def _note_placement(self, args: tuple) -> None:
        for a in args:
            if isinstance(a, GlobalTensor):
                p = a._layout.placement
                if p not in self._placements:
                    self._placements.append(p)
                return

    def _axis(self, group: tuple, route: Any) -> str:
        placements = [q.dst.placement for q in (route if isinstance(route, tuple) else (route,)) if q is not None]
        placements += [q.src.placement for q in (route if isinstance(route, tuple) else (route,)) if q is not None]
        for p in placements + self._placements:
            if self.rank not in p:
                continue
            for a in range(p.ndim):
                if tuple(p.group(self.rank, a)) == group:
                    return str(a)
            if tuple(sorted(p.flat_ranks)) == tuple(sorted(group)):
                return "all"
        return "ranks " + ",".join(map(str, group))

    # -- reading ---------------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """Collectives grouped by (module, phase, op, kind, axis, reason): count, bytes, lower bound."""
        out: dict[tuple, dict] = {}
        for c in self.collectives:
            key = (c.module, c.phase, c.op, c.kind, c.axis, c.reason)
            row = out.get(key)
            if row is None:
                row = out[key] = {"module": c.module, "phase": c.phase, "op": c.op, "kind": c.kind, "axis": c.axis,
                                  "reason": c.reason, "count": 0, "recv_bytes": 0, "lower_bound": 0}
            row["count"] += 1
            row["recv_bytes"] += c.recv_bytes
            if row["lower_bound"] is not None:
                row["lower_bound"] = None if c.lower_bound is None else row["lower_bound"] + c.lower_bound
        return list(out.values())

    def by_module(self, phase: Optional[str] = None) -> dict[str, int]:
        """{module path: bytes received}, its own collectives only (children apart); one phase or all."""
        out: dict[str, int] = {}
        for c in self.collectives:
            if phase is None or c.phase == phase:
                out[c.module] = out.get(c.module, 0) + c.recv_bytes
        return out

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "recv_bytes": self.recv_bytes,
                "collectives": len(self.collectives), "rows": self.rows(),
                "events": [dict(asdict(c), group=list(c.group)) for c in self.collectives]}

    def to_json(self, path: Optional[str] = None) -> str:
        """The report as JSON (rows grouped as in the tree, and every collective); written to `path` if given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def chrome_trace(self, path: Optional[str] = None, all_ranks: bool = False) -> dict:
        """chrome://tracing (Perfetto) JSON: each collective a span from its start to its end, and the
        compute between them; one row per rank (pid), wall-clock timestamps (comparable across gloo
        processes on one machine; on the simulator ranks take turns, so spans include waiting).

        `all_ranks=True` is a collective (every rank calls it): rank 0 gets and writes every rank's
        spans in one trace, the other ranks return theirs and write nothing."""
        if all_ranks:
            comm = context.current()
            mine = self.chrome_trace()["traceEvents"]
            every = comm.all_gather_object(mine, tuple(range(comm.world_size)))
            trace = {"traceEvents": [e for evs in every for e in evs], "displayTimeUnit": "ms"}
            if path is not None and comm.rank == 0:
                with open(path, "w") as f:
                    json.dump(trace, f)
            return trace if comm.rank == 0 else {"traceEvents": mine, "displayTimeUnit": "ms"}
        events, last = [], None
        for c in self.collectives:
            if last is not None and c.start_ns > last:
                events.append({"name": "compute", "ph": "X", "pid": self.rank, "tid": 0, "ts": last / 1e3,
                               "dur": (c.start_ns - last) / 1e3, "cat": "compute"})
            events.append({"name": f"{c.kind} {_name(c.module)}", "ph": "X", "pid": self.rank, "tid": 0,
                           "ts": c.start_ns / 1e3, "dur": max(c.end_ns - c.start_ns, 0) / 1e3, "cat": c.phase,
                           "args": {"op": c.op, "axis": c.axis, "bytes": c.recv_bytes, "reason": c.reason}})
            last = c.end_ns
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    def tree(self, reasons: bool = True) -> str:
        """Modules as a tree, each with its bytes (children included) and its own collectives."""
        rows = self.rows()
        by_phase: dict[str, list] = {}
        for c in self.collectives:
            by_phase.setdefault(c.phase, []).append(c.recv_bytes)
        head = ", ".join(f"{p} {len(by_phase[p])} / {sum(by_phase[p])} B"
                         for p in ("forward", "backward", "outside") if p in by_phase)
        lines = [f"rank {self.rank} of {self.world_size}: {len(self.collectives)} collectives, "
                 f"{self.recv_bytes} B received ({head or 'nothing'})"]
        own: dict[str, list] = {}
        for r in rows:
            own.setdefault(r["module"], []).append(r)
        total: dict[str, list] = {}  # path -> [count, bytes] of the subtree
        for path, rs in own.items():
            for anc in _ancestors(path):
                t = total.setdefault(anc, [0, 0])
                t[0] += sum(r["count"] for r in rs)
                t[1] += sum(r["recv_bytes"] for r in rs)
        rank_of = {p: i for i, p in enumerate(self._names.values())}  # modules in named_modules() order
        order = sorted(total, key=lambda p: (p == _OUTSIDE, _path_key(p, rank_of)))
        for path in order:
            depth = 0 if path in ("", _OUTSIDE) else path.count(".") + 1
            pad = "  " * depth
            count, nb = total[path]
            lines.append(f"{pad}{_name(path)}: {count} x, {nb} B")
            for r in own.get(path, ()):
                lb = "" if r["lower_bound"] is None or r["lower_bound"] == r["recv_bytes"] else \
                    f" (lower bound {r['lower_bound']} B)"
                line = (f"{pad}  {r['phase']:<8} {r['kind']:<14} axis {r['axis']:<4} {r['count']:>3} x "
                        f"{r['recv_bytes']:>8} B{lb}")
                if reasons:
                    line += f"  {r['reason']}"
                lines.append(line)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.tree()


def _name(path: str) -> str:
    return "<root>" if path == "" else path


def _ancestors(path: str) -> list[str]:
    if path == _OUTSIDE:
        return [path]
    if path == "":
        return [""]
    parts = path.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _path_key(path: str, order: dict) -> tuple:
    parts = [] if path in ("", _OUTSIDE) else path.split(".")
    return tuple(order.get(".".join(parts[:i + 1]), 10 ** 6) for i in range(len(parts)))


def _op_name(func: Any) -> str:
    name = str(func)
    return name[:-8] if name.endswith(".default") else name


def _layout_text(layout: Any) -> str:
    sbp = layout.sbp
    return str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(map(str, sbp)) + ")"


def _conversion(route: Any) -> str:
    if route is None:
        return ""
    if isinstance(route, tuple):
        if not route:
            return ""
        p = route[0]
        return f" ({len(route)} tensors in one bucket: {_layout_text(p.src)} -> {_layout_text(p.dst)})"
    return f" {list(route.shape)}: {_layout_text(route.src)} -> {_layout_text(route.dst)}"


def _argument(route: Any, args: tuple) -> str:
    """Which argument of the op the conversion is for (by layout and shape; the first that fits)."""
    if isinstance(route, tuple):
        return "arguments"
    flat: list = []
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            flat.extend((f"{i}[{j}]", b) for j, b in enumerate(a))
        else:
            flat.append((str(i), a))
    for where, a in flat:
        if isinstance(a, GlobalTensor) and a._layout == route.src and tuple(a.shape) == tuple(route.shape):
            return f"argument {where}"
    for where, a in flat:
        if isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor) and tuple(a.shape) == tuple(route.shape):
            return f"argument {where} (a plain tensor, taken as Broadcast)"
    return "an intermediate value"


def _lower_bound(route: Any, rank: int) -> Optional[int]:
    routes = route if isinstance(route, tuple) else (route,)
    total = 0
    for p in routes:
        if p is None or p.lower_bound is None:
            return None
        total += p.lower_bound[rank] if rank < len(p.lower_bound) else 0
    return total


# -- module hooks ---------------------------------------------------------------------------------
class _Hooks:
    """The hooks of one report on one thread: module frames pushed and popped, autograd nodes tagged."""

    def __init__(self, report: CommReport) -> None:
        self.report = report
        self.handles: list = []
        self.attached: set[int] = set()

    def attach(self, root: torch.nn.Module, prefix: str = "") -> None:
        for name, mod in root.named_modules(prefix=prefix):
            if id(mod) in self.attached:
                continue
            self.attached.add(id(mod))
            self.report._names.setdefault(id(mod), name)
            self.handles += [
                mod.register_forward_pre_hook(self._enter(name), prepend=True),
                mod.register_forward_pre_hook(self._stage("body", 1)),
                mod.register_forward_hook(self._leaving, prepend=True),
                mod.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, path: str) -> Any:
        def enter(module: torch.nn.Module, args: tuple) -> None:
            if self._mine():
                STATE.frames.append(_Frame(path, "input", torch._C._autograd._get_sequence_nr(), id(module)))
        return enter

    def _mine(self) -> bool:
        """Whether this thread's innermost open report is this one (ranks may share a model's hooks)."""
        return STATE.reporting > 0 and _ACTIVE.get(threading.get_ident()) is self

    def _stage(self, stage: str, index: int) -> Any:
        def set_stage(module: torch.nn.Module, *rest: Any) -> None:
            if self._mine() and STATE.frames and STATE.frames[-1].module == id(module):
                frame = STATE.frames[-1]
                frame.stage = stage
                frame.seq[index] = torch._C._autograd._get_sequence_nr()
        return set_stage

    def _leaving(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._stage("output", 2)(module)

    def _leave(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not (self._mine() and STATE.frames and STATE.frames[-1].module == id(module)):
            return  # a call that began before the report opened
        frame = STATE.frames.pop()
        if torch.is_grad_enabled():
            _tag(output, frame)

    def discover(self, module: torch.nn.Module, args: tuple) -> None:
        """Global pre-hook: a module called at the top level that the report was not given."""
        if STATE.reporting and not STATE.frames and id(module) not in self.attached:
            self.attach(module)
            frame = _Frame("", "body", torch._C._autograd._get_sequence_nr(), id(module))  # its pre-hooks ran
            STATE.frames.append(frame)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _tag(output: Any, frame: _Frame) -> None:
    """Tag the autograd nodes this module call created (sequence numbers since it started) with its path."""
    roots = [t.grad_fn for t in tensors(output) if t.grad_fn is not None]
    seen: set = set()
    start, body, out = frame.seq
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq = node._sequence_nr()
        if seq < start or seq >= 2 ** 62:  # older than this call (or an AccumulateGrad's maximal number)
            continue
        meta = node.metadata
        if _TAG not in meta:
            meta[_TAG] = (frame.path, "input" if seq < body else "body" if seq < out else "output")
        roots.extend(n for n, _ in node.next_functions)


_GLOBAL = {"handle": None, "count": 0}
_GLOBAL_LOCK = threading.Lock()
_ACTIVE: dict[int, _Hooks] = {}  # thread id -> the hooks of its open report (the innermost)


def _global_pre_hook(module: torch.nn.Module, args: tuple) -> None:
    hooks = _ACTIVE.get(threading.get_ident())
    if hooks is not None:
        hooks.discover(module, args)


# a no-op on threads without a report open: a pipeline's replay (which no reporting thread runs) need not run it
_global_pre_hook.acts_on_reporting_threads = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def comm_report(*modules: torch.nn.Module) -> Iterator[CommReport]:
    """Record this rank's collectives with module, op, phase, mesh axis, bytes and reason.

    `with gt.comm_report(model) as rep: ...; print(rep)` prints the tree; `rep.to_json()`,
    `rep.chrome_trace(path)`, `rep.rows()`, `rep.collectives`. Modules given are named by their
    `named_modules()` paths (the root is ""); modules called at the top level that were not given are
    discovered and named the same way from themselves. Every event of an enclosing `gt.comm_log()`
    is in the report too (the sums agree).
    """
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"comm_report(*modules): expected nn.Module, got {type(m).__name__}")
    comm = context.current()
    report = CommReport(comm.rank, comm.world_size, {})
    hooks = _Hooks(report)
    for m in modules:
        hooks.attach(m)
    me = threading.get_ident()
    outer = _ACTIVE.get(me)
    frames_before = list(STATE.frames)
    with _GLOBAL_LOCK:
        if _GLOBAL["count"] == 0:
            _GLOBAL["handle"] = torch.nn.modules.module.register_module_forward_pre_hook(_global_pre_hook)
        _GLOBAL["count"] += 1
        FLAGS.reports += 1
        FLAGS.refresh()
    _ACTIVE[me] = hooks
    STATE.reporting += 1
    comm._logs.append(report)
    try:
        yield report
    finally:
        comm._logs[:] = [g for g in comm._logs if g is not report]  # by identity: logs compare by their events
        STATE.reporting -= 1
        STATE.frames[:] = frames_before
        if outer is None:
            _ACTIVE.pop(me, None)
        else:
            _ACTIVE[me] = outer
        hooks.remove()
        with _GLOBAL_LOCK:
            _GLOBAL["count"] -= 1
            if _GLOBAL["count"] == 0:
                _GLOBAL["handle"].remove()
            FLAGS.reports -= 1
            FLAGS.refresh()
