"""ZeRO as placement: a module's parameters are stored in one layout and computed in another.

A parameter stored `S(0)` over the data axis has an `S(0)` gradient and an `S(0)` optimizer state
(torch.optim makes it with `zeros_like`), so the update runs on the shard with unchanged optimizers.
While the module that owns it runs, it takes its compute layout (usually Broadcast): every parameter
of the module is converted at once, one collective per bucket (`boxing.execute_many`), as FSDP
gathers per module. The conversion is an autograd function whose backward is its dual: the
gradients, in whatever layout the module's backward leaves them (Partial over the data axis, as
data parallelism makes them), are converted into the stored layout, again one collective per
bucket: the reduce-scatter. It runs when the last of the module's gradients is ready, which is
when autograd calls it.

ZeRO-3 (`reshard_after_forward=True`) frees the gathered copies when the forward leaves the module
and gathers them again when the backward enters it, started one module ahead (when the backward
enters the module that ended after it in the forward), as FSDP2 prefetches. A module called again inside the same
enclosing module, with no other gathering between (a layer shared by every depth), reuses its call (`_park`).
Autograd keeps the tensors it saved, but their
shards' storage is what is freed (resized to nothing, as FSDP2 does) and later refilled in place,
so the saved tensors and their views see the data again without a saved-tensor hook. ZeRO-2 keeps
the gathered copies until the module's backward has reduced the gradients. Either way nothing
gathered outlives the backward.

A compute dtype (`param_dtype`) casts the shard before the gather, so the gather moves the smaller
dtype and the module computes in it (fp32 stored, bf16 used: mixed precision); its floating inputs
are cast too. Gradients are reduced in `reduce_dtype` (default: as they come) and stored in the
parameter's dtype.

Frozen and unused parameters, as FSDP2 treats them: a frozen one (`requires_grad=False`) is gathered with
the others but its copy takes no gradient, and one the forward never reads gets none (not zeros), so
their `.grad` stays None, the optimizer skips them, and the reduce-scatter carries only the gradients that
exist. A module whose parameters are all frozen still re-gathers them for its backward (its inputs'
gradients read them) and frees them where that backward ends (`_Release`, on its inputs).

Under torch.compile the hooks trace instead (`_traced_gather`): the gathers and reduce-scatters are graph ops, and
ZeRO-3's free-and-regather is the partitioner's recomputation of the gather in the backward graph.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional, Protocol

import torch

from .. import boxing
from ..layout import Layout
from ..ops import dispatch
from ..ops.scope import enter_named_here
from ..runtime import context
from ..sbp import Broadcast, Partial
from ..tensor import GlobalTensor, grad_layout
from .trees import map_tensors


@dataclass(frozen=True, eq=False)
class ParamGroup:
    """The parameters one module gathers: its own, recursively, except those of submodules that
    gather their own. `slots` are the (module, attribute) places they are read from (a tied
    parameter has several), `compute` their layouts while the module runs."""
    where: str
    params: tuple
    slots: tuple                      # (module, name, index into params)
    compute: tuple                    # per parameter: the Layout it takes while the module runs
    reshard_after_forward: bool
    param_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]

    def __post_init__(self) -> None:
        _number(self)

    def __getstate__(self) -> dict:  # the slot is this process's: renumbered where the group is loaded
        return {k: v for k, v in self.__dict__.items() if k != "_slot"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _number(self)

    def routes_for(self, conversions: tuple, which: Optional[tuple] = None) -> list:
        """Boxing routes for (src, dst, dtype) per parameter (or per parameter in `which`), remembered
        per group: every step asks for the same ones."""
        key = (conversions, which)
        remembered = _state(self).setdefault("routes", {})
        routes = remembered.get(key)
        if routes is None:
            idx = range(len(self.params)) if which is None else which
            routes = remembered[key] = [boxing.route(src, dst, tuple(self.params[i].shape), dtype)
                                        for i, (src, dst, dtype) in zip(idx, conversions)]
        return routes

    # hooks are bound methods, not closures, so that a converted module pickles and deep-copies
    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        """Forward pre-hook: gather (or finish the prefetch of this module's gather), start the next
        module's gather, and read the gathered parameters from the module's slots.

        The next module is the one that followed this one in the previous forward (inside the same
        outer gathering module: never across a step, whose optimizer changes the parameters)."""
        if torch.compiler.is_compiling():
            return self._traced_before(args, kwargs)
        listener = _LISTENING.listener
        if listener is None:
            return self._before(module, args, kwargs)
        with listener.opening(self, module):
            return self._before(module, args, kwargs)

    def _traced_before(self, args: tuple, kwargs: dict) -> tuple:
        """The pre-hook under torch.compile: the gather is a graph op (`_traced_gather`), its copies go in the
        module's slots (dynamo records the change), and `after` puts the stored parameters back. What eager
        mode does by hand around the gather (freeing, re-gathering, prefetching, landing the reduced gradients)
        is the graph's: see `_traced_gather`."""
        gathered = _traced_gather(self._slot, tuple(self.params))
        for mod, name, i in self.slots:
            mod._parameters[name] = gathered[i]
        if self.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.param_dtype)
        return args, kwargs

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        mine = _state(self)
        scope = _SCOPES.get(context.current())
        keeps = scope is not None and not self.reshard_after_forward  # one call for the scope's micro-batches
        kept = scope.calls.get(self) if keeps else None
        again, again_outputs = _unpark(self)
        call = again or kept or mine.pop("prefetched", None) or _Call(self)
        if keeps:
            scope.calls[self] = call
        if _OPEN.stack and _OPEN.last is not None and _OPEN.last is not self:
            _state(_OPEN.last)["next"] = self
        _OPEN.last = self
        params = [p for p in self.params]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            # kept for the step: every micro-batch takes the same outputs of one gather (one node, whose backward
            # each micro-batch's backward runs, or a one-rank stage hands the step's sum to once: `hand_on`)
            gathered = scope.outputs.get(self) if keeps else again_outputs
            if gathered is None:
                gathered = _Gather.apply(call, *params)
                if keeps:
                    scope.outputs[self] = gathered
        else:
            gathered = call.gather()
            if torch.is_grad_enabled() and not keeps:
                # every parameter frozen: no gradient to reduce, but the inputs' gradients may read the gathered
                # copies (a frozen Linear's weight), so the module's backward is marked at both ends, as FSDP2's
                # hooks on its inputs and outputs mark it: it gathers again where it begins and frees where it ends
                args, kwargs = _release_at_inputs((args, kwargs), call)
        for mod, name, i in self.slots:
            mod._parameters[name] = gathered[i]
        _OPEN.installed.append(gathered)
        # the next module is a sibling (taken inside the enclosing call) or, for the outermost, its first child
        owner = _OPEN.stack[-1] if _OPEN.stack else call
        if owner is not call:
            owner.entered.add(self)
        nxt = mine.get("next")
        # a module already called in this forward is not gathered ahead again: a call that follows another
        # module (A, B, A) would start a gather for what came after A the first time, which no call may take
        if nxt is not None and nxt not in owner.entered and "prefetched" not in _state(nxt) and \
                not (scope is not None and nxt in scope.calls):
            ahead = _state(nxt)["prefetched"] = _Call(nxt)
            ahead.start()
            owner.prefetches.append(ahead)
        _OPEN.stack.append(call)
        if self.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.param_dtype)
        return args, kwargs

    def unwind(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        """Forward hook run even when the forward raised (`always_call`): where `after` did not run, this call
        is still open; its stored parameters go back in their slots and its gathered copies are freed, so an
        exception leaves the module, and this thread's stack of open calls, as they were before it."""
        if torch.compiler.is_compiling():
            return  # dynamo applies the slots' changes only once the graph ran
        if not _OPEN.stack or _OPEN.stack[-1].group is not self:
            return  # `after` closed it: the forward returned
        call = _OPEN.stack.pop()
        _OPEN.installed.pop()
        for mod, name, i in self.slots:
            mod._parameters[name] = self.params[i]
        _flush(call)
        if not call.freed:
            call.free()

    def after(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """Forward hook: the stored parameters back in their slots; ZeRO-3 frees the gathered copies
        and marks the output so that its backward gathers them again first."""
        if torch.compiler.is_compiling():
            for mod, name, i in self.slots:
                mod._parameters[name] = self.params[i]
            return _traced_outputs(self._slot, output) if _taking_grad(output) else output
        listener = _LISTENING.listener
        if listener is not None:
            listener.closed(self, module)
        call = _OPEN.stack.pop()
        gathered = _OPEN.installed.pop()
        for mod, name, i in self.slots:
            mod._parameters[name] = self.params[i]
        kept = _SCOPES.get(context.current())
        if kept is not None and kept.calls.get(self) is call:  # kept for the scope's next micro-batches
            _flush(call)
            # a module run on plain tensors (a one-rank stage) dispatches nothing in its backward: no named
            # scope for it to enter, no gather to redo
            return _mark_outputs(output, call) if call.tracked and not _state(self).get("plain") else output
        if not call.tracked:      # no backward will come through these: nothing to keep ...
            if torch.is_grad_enabled() and _taking_grad(output):
                # ... unless one comes through a submodule's trainable parameters (no input took a gradient to
                # mark the backward's end at): the copies stay for it, held by what autograd saved of them
                _flush(call)
                return output
            _park(call, None, free=True)
            return output
        if self.reshard_after_forward:
            _park(call, gathered, free=True)
            # the backward meets the modules' ends in reverse: this call's backward comes right before
            # that of the call that ended before it, whose re-gather it starts (prefetch); a call taken again
            # (`_unpark`) ends twice, its backward still once
            if _OPEN.ended is None or _OPEN.ended() is not call:
                call.before_in_backward, _OPEN.ended = _OPEN.ended, weakref.ref(call)
        else:
            _park(call, gathered, free=False)
        return _mark_outputs(output, call)


_GROUPS: "weakref.WeakValueDictionary[int, ParamGroup]" = weakref.WeakValueDictionary()  # slot -> group
_NEXT_SLOT = itertools.count()


def _number(group: ParamGroup) -> None:
    """A group's slot: the int its compiled hook hands dynamo (`_traced_gather`), which guards it as a constant."""
    slot = next(_NEXT_SLOT)
    object.__setattr__(group, "_slot", slot)
    _GROUPS[slot] = group


@torch._dynamo.nonstrict_trace
def _traced_gather(slot: int, params: tuple) -> tuple:
    """A gathering module's parameters in their compute layouts, traced: dynamo leaves this call opaque,
    AOTAutograd traces it (`_TracedGather`), so the group's all-gathers are forward graph ops and their duals
    (the gradients, Partial over the data axis, reduce-scattered into the stored layouts) backward graph ops,
    one collective per bucket as eagerly, landing in `.grad` as any leaf's gradient.

    ZeRO-3 (`reshard_after_forward`) frees the gathered copies after the forward and gathers them again in the
    backward: here the gather's nodes are marked to be recomputed (`recompute`, what `torch.utils.checkpoint`'s
    selective policy sets under compile, SimpleFSDP's way), so AOTAutograd's partitioner saves the shards, not
    the copies, and repeats the all-gather in the backward graph. ZeRO-2 saves the copies for the backward."""
    group = _GROUPS[slot]
    with _recomputed(group.reshard_after_forward):
        out = list(_TracedGather.apply(slot, *params))
        trainable = [i for i, t in enumerate(out) if t.requires_grad]
        if trainable and torch.is_grad_enabled():
            marked = _TracedScope.apply(slot, False, *(out[i] for i in trainable))
            for i, t in zip(trainable, marked):
                out[i] = t
        return tuple(out)


def _frozen_marked(ctx: Any, out: tuple, params: tuple) -> tuple:
    """A gather's outputs, a frozen parameter's copy marked as taking no gradient: as FSDP2, it is gathered, but
    its module's backward must not make it a gradient the reduce-scatter lands in a `.grad` the optimizer applies."""
    frozen = [t for t, p in zip(out, params) if not p.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    return out


class _TracedGather(torch.autograd.Function):
    """`_Gather` as AOTAutograd traces it: the parameters handed in (the traced ones, not the group's) to their
    compute layouts, one collective per bucket (`boxing.execute_many`); backward, the gradients to the stored
    layouts (`_Call.reduce_start`, eager's reduction), with no freeing, prefetching nor landing: the graph
    orders its collectives, and autograd accumulates the reduced gradients."""

    @staticmethod
    def forward(ctx, slot: int, *params: GlobalTensor) -> tuple:  # type: ignore[override]
        g = _GROUPS[slot]
        ctx.slot = slot
        ctx.set_materialize_grads(False)
        shards = [p._local if g.param_dtype is None or p._local.dtype == g.param_dtype else p._local.to(g.param_dtype)
                  for p in params]
        routes = g.routes_for(tuple((p._layout, c, s.dtype) for p, c, s in zip(params, g.compute, shards)))
        outs = boxing.execute_many(routes, shards, context.current())
        return _frozen_marked(ctx, tuple(GlobalTensor(o, c, tuple(p.shape)) for o, c, p in
                                         zip(outs, g.compute, params)), params)

    @staticmethod
    def backward(ctx, *grads: Any) -> tuple:  # type: ignore[override]
        return (None, *_Call(_GROUPS[ctx.slot]).reduce_start(grads)())


@torch._dynamo.nonstrict_trace
def _traced_outputs(slot: int, output: Any) -> Any:
    """A gathering module's outputs under torch.compile, marked where the module's backward begins (eager's
    `_Regather` marks, less the re-gather, which the graph holds)."""
    return map_tensors(lambda t: _TracedScope.apply(slot, True, t)[0] if t.requires_grad else t, output)


class _Traced(threading.local):
    def __init__(self) -> None:
        self.leaves: dict = {}  # group slot -> the leave of the named scope its traced backward entered


_TRACED = _Traced()


class _TracedScope(torch.autograd.Function):
    """Identity; its backward, traced by AOTAutograd, enters (on the module's outputs) or leaves (on the
    gathered parameters, before their reduce-scatter) the named scope the module's backward runs in, as
    eager's `_Regather` and `_Gather` do: the cost model leaves a Partial of a parameter's shape for the
    reduce-scatter there (the same plan as eager, and so the same bytes)."""

    @staticmethod
    def forward(ctx, slot: int, enter: bool, *xs: torch.Tensor) -> tuple:  # type: ignore[override]
        ctx.slot, ctx.enter = slot, enter
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: Any) -> tuple:  # type: ignore[override]
        leaves = _TRACED.leaves
        if ctx.enter:
            if ctx.slot not in leaves:
                leaves[ctx.slot] = enter_named_here(tuple(q.shape) for q in _GROUPS[ctx.slot].params)
        else:
            leave = leaves.pop(ctx.slot, None)
            if leave is not None:
                leave()
        return (None, None, *grads)


_AC_IDS = itertools.count(1 << 20)  # apart from torch.utils.checkpoint's region numbers


@contextlib.contextmanager
def _recomputed(on: bool) -> Iterator[None]:
    """Nodes traced inside are to be recomputed in the backward, one region of their own (the tags AOTAutograd's
    partitioners read: `must_recompute`, `ac_graph_id`)."""
    from torch.fx import traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy
    if not on or not fx_traceback.has_preserved_node_meta():
        yield
        return
    meta = fx_traceback.current_meta
    before = {k: meta[k] for k in ("recompute", "ac_graph_id") if k in meta}
    meta["recompute"], meta["ac_graph_id"] = CheckpointPolicy.MUST_RECOMPUTE, next(_AC_IDS)
    try:
        yield
    finally:
        for k in ("recompute", "ac_graph_id"):
            meta.pop(k, None)
        meta.update(before)


class _Open(threading.local):
    def __init__(self) -> None:
        self.stack: list = []
        self.installed: list = []  # per open call, the gathered parameters it put in its module's slots
        self.last: Optional[ParamGroup] = None
        # the ZeRO-3 call whose forward ended last, since the last backward; weak, as the links between calls
        # are: a forward never backpropagated (its graph dropped) leaves no call for a later backward to prefetch
        self.ended: Optional["weakref.ref[_Call]"] = None


_OPEN = _Open()  # per thread (simulated rank, pipeline fiber): the module calls whose parameters are gathered,
                 # and the group whose forward started last


class GatherListener(Protocol):
    """Told of this thread's gathering modules' hooks (`listening`): whoever must see a gather as it runs
    (a recording of what a rank does, to run it again) without ZeRO knowing who it is."""

    def opening(self, group: ParamGroup, module: torch.nn.Module) -> ContextManager[None]:
        """Around the forward pre-hook's work: what happens inside (its collectives) is the hook's."""

    def closed(self, group: ParamGroup, module: torch.nn.Module) -> None:
        """The forward hook: the module's gathered parameters are put back."""


class _Listening(threading.local):
    listener: Optional[GatherListener] = None


_LISTENING = _Listening()


@contextlib.contextmanager
def listening(listener: GatherListener) -> Iterator[None]:
    """`listener` is told of the gathering modules' hooks run on this thread while the scope is open."""
    before, _LISTENING.listener = _LISTENING.listener, listener
    try:
        yield
    finally:
        _LISTENING.listener = before


def runs_plain(group: ParamGroup) -> None:
    """The group's module computes on its gathered copies' plain local tensors, outside the dispatcher (whoever
    runs it so swaps them in): its backward dispatches nothing, so its outputs take no `_Regather` mark."""
    _state(group)["plain"] = True


def kept_output(t: torch.Tensor) -> bool:
    """Whether `t` is a gathered parameter kept for the step (`accumulating`): the same tensor in every micro-batch,
    whose gradient may be summed over them and handed to its gather once."""
    node = t.grad_fn
    if type(node) is not _GATHER_BACKWARD:
        return False
    scope = _SCOPES.get(context.current())
    return scope is not None and scope.calls.get(node.call.group) is node.call


def gathering() -> bool:
    """Whether a gathering module's forward is open on this thread (its forward hook still to come)."""
    return bool(_OPEN.stack)


def reinstall() -> None:
    """Put this thread's open calls' gathered parameters back in their modules' slots (outermost first).

    The slots are the module's, shared by every thread that runs it, but what a forward reads from them
    must be its own call's tensors: each is an output of that call's `_Gather`, through which its
    gradient returns. An interleaved pipeline runs a micro-batch's forward as a fiber (a thread) that
    stops between chunks while other micro-batches' forwards enter and leave the same modules (the root,
    whose parameters span the chunks), changing the slots; the fiber calls this when it resumes. Without
    it a micro-batch's last chunk read another micro-batch's gathered parameters, so its gradient went to
    that call's `_Gather`, whose other gradients autograd then made up as plain zeros."""
    for call, gathered in zip(_OPEN.stack, _OPEN.installed):
        for mod, name, i in call.group.slots:
            mod._parameters[name] = gathered[i]
_STATE: "weakref.WeakKeyDictionary[ParamGroup, dict]" = weakref.WeakKeyDictionary()


def _state(group: ParamGroup) -> dict:
    """A group's run-time state (its routes, the next group, a prefetched gather), kept out of the
    group itself so that a converted module pickles and deep-copies without it."""
    st = _STATE.get(group)
    if st is None:
        st = _STATE[group] = {}
    return st


class _Call:
    """One call of a gathering module: its gathered shards, freed and refilled in place."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group
        self.rank = context.current().rank
        _LIVE.add(self)
        self.locals: list = []        # gathered shard per parameter
        self.owned: list = []         # whether that shard is a copy of ours to free (not the stored one)
        self.freed = False
        self.tracked = False          # an autograd function holds this call (a backward will come)
        self.scopes: dict = {}        # thread -> leave: the backwards running in the named scope, one per thread
        self.pending: Any = None      # a started gather (prefetch) to finish
        self.reduced = False          # its backward has run
        self.before_in_backward: Optional["weakref.ref[_Call]"] = None  # the call whose backward comes next
        self.prefetched: Optional["_Call"] = None  # that call, once its re-gather is started by this one's backward
        # calls of inner modules whose forward ended inside this one and which may be called again (`_park`), with
        # their gathered outputs (None: not through a `_Gather`); and whether this one, parked, frees when flushed
        self.parked: list = []
        self.frees_when_flushed = False
        self.entered: set = set()      # the groups called inside this call's forward
        self.prefetches: list = []     # the calls its forward started ahead: dropped at its end if none took them

    def start(self) -> None:
        """Start the gather now (a prefetch); `gather` finishes it."""
        self.pending = self._start()

    def _gathered_locals(self, into: Optional[list] = None) -> list:
        pending, self.pending = self.pending, None
        return pending(into) if pending is not None else self._start()(into)

    def _start(self) -> Any:
        g = self.group
        shards = []
        for p in g.params:
            local = p._local
            if g.param_dtype is not None and local.dtype != g.param_dtype:
                local = local.to(g.param_dtype)
            shards.append(local)
        return boxing.execute_many_start(g.routes_for(tuple((p._layout, c, s.dtype) for p, c, s in
                                                          zip(g.params, g.compute, shards))), shards,
                                         context.current())

    def gather(self) -> list:
        """The parameters in their compute layouts, as GlobalTensors on the gathered shards (gathered
        once per call; a call kept by `accumulating()` hands out the same shards to every micro-batch)."""
        g = self.group
        if not self.locals or self.freed:
            self.locals = self._gathered_locals()
            self.owned = [storage_key(out) != storage_key(p._local) for out, p in zip(self.locals, g.params)]
            self.freed = False
        return [GlobalTensor(out, c, tuple(p.shape)) for out, c, p in zip(self.locals, g.compute, g.params)]

    def free(self) -> None:
        """Release the gathered copies' memory; tensors saved for backward keep only metadata."""
        if self.freed:
            return
        for t, owned in zip(self.locals, self.owned):
            if owned:
                t.untyped_storage().resize_(0)
        self.freed = True

    def prefetch_regather(self) -> None:
        """Start the backward's gather now (the next module's backward is about to start)."""
        if self.freed and not self.reduced and self.pending is None:
            self.pending = self._start()

    def regather(self) -> None:
        """Gather again into the freed shards (ZeRO-3's backward all-gather): their storage is given back its
        size and the all-gather copies out straight into it, as FSDP2's copy-out into its unsharded parameters
        (not into new tensors copied over once more)."""
        if not self.freed:
            return
        into = []
        for t, owned in zip(self.locals, self.owned):
            if owned:
                t.untyped_storage().resize_((t.storage_offset() + t.numel()) * t.element_size())
            into.append(t if owned else None)
        # the copy-out must not count as a write (FSDP2's copy-out doesn't either): a module that computes on the
        # shards themselves (a plain region, `runs_plain`) saved them for its backward, and a frozen parameter's
        # shard is saved as it is, not through an autograd node, whose version autograd checks when it reads it
        with torch.autograd._unsafe_preserve_version_counter(tuple(t for t in into if t is not None)):
            self._gathered_locals(into)  # the all-gather copies out straight into them
        self.freed = False

    def backward_done(self) -> None:
        """The module's backward is done: free its gathered copies and finish the next module's prefetched
        gather into that module's parameters."""
        self.reduced = True
        self.free()
        ahead, self.prefetched = self.prefetched, None
        if ahead is not None and not ahead.reduced:  # (reduced already: the backward went another way)
            ahead.regather()

    def enter_scope(self) -> None:
        """The module's backward runs in a scope that names its parameters' gradients (the cost model leaves
        a Partial of a parameter's shape for the module's reduce-scatter; an activation's gradient is charged
        its reduction as anywhere). The scope is per thread (ops/scope.py), and a
        call kept for a pipeline step is in several backwards at once, one per micro-batch, each on its
        own fiber's thread when interleaved: each thread enters (and leaves) it for itself."""
        me = threading.get_ident()
        if me not in self.scopes:
            self.scopes[me] = enter_named_here(tuple(q.shape) for q in self.group.params)

    def leave_scope(self) -> None:
        if not self.scopes:
            return
        leave = self.scopes.pop(threading.get_ident(), None)
        if leave is None:  # left from another thread than the one that entered (a device's backward thread)
            leave = self.scopes.pop(next(iter(self.scopes)))
        leave()

    def reduce_start(self, grads: tuple, keep_partial: bool = False) -> Any:
        """Gradients in the compute layouts -> the stored layouts and dtypes (the dual of `gather`), started
        now (its reduce-scatter may stay in flight), finished by calling the result. `keep_partial`: a
        Partial axis on which the parameter is stored Broadcast stays Partial (`_kept_partial`), unless
        the group reduces in another dtype than the parameter's (the bucket would reduce it in the latter)."""
        g = self.group
        # a frozen parameter's gradient is dropped wherever it came from (a pipeline hands gradients on too)
        which = [i for i, gr in enumerate(grads) if gr is not None and g.params[i].requires_grad]
        targets = {i: _kept_partial(grads[i]._layout, g.params[i]._layout) if keep_partial and
                   isinstance(grads[i], GlobalTensor) and g.reduce_dtype in (None, g.params[i].dtype)
                   else g.params[i]._layout for i in which}
        locals_, conversions = [], []  # (source layout, target layout, dtype) per gradient
        for i in which:
            gr = grads[i]
            if not isinstance(gr, GlobalTensor):
                raise TypeError(f"{g.where}: the gradient of a gathered parameter is a plain tensor; "
                                "every op on a GlobalTensor should give GlobalTensors")
            local = gr._local
            if g.reduce_dtype is not None and local.dtype != g.reduce_dtype:
                local = local.to(g.reduce_dtype)
            locals_.append(local)
            conversions.append((gr._layout, targets[i], local.dtype))
        done = boxing.execute_many_start(g.routes_for(tuple(conversions), tuple(which)), locals_, context.current())
        n = len(grads)

        def finish() -> list:
            # closes over no gradient (full-size, Partial): they are freed while the reduce-scatter is in flight,
            # whose send buffer holds what it needs
            result: list = [None] * n
            for i, out in zip(which, done()):
                p = g.params[i]
                result[i] = GlobalTensor(out.to(p.dtype), targets[i], tuple(p.shape))
            return result
        return finish


def _park(call: _Call, gathered: Optional[list], free: bool) -> None:
    """A call whose forward ended: kept (its copies not freed yet, its `_Gather` outputs at hand) while its
    enclosing gathering module's forward goes on, until another module gathers there or that module's forward
    ends (`_flush`). A module called again in between (ALBERT's one layer, run at every depth) takes the same
    call (`_unpark`): one gather for all its calls, and, through its one `_Gather` node, whose backward
    autograd runs once with the calls' gradients summed, one re-gather and one reduce-scatter in the backward:
    the textbook's bytes, where gathering per call (FSDP2) moves them once per call. Other modules free their
    copies a little later (when the next module gathers, which is also when its prefetched gather lands),
    moving the same bytes. Without an enclosing call (the outermost module), or inside one kept for a step's
    micro-batches (`accumulating`, shared by their forwards), it is released now."""
    call.frees_when_flushed = free
    outer = _OPEN.stack[-1] if _OPEN.stack else None
    scope = _SCOPES.get(context.current())
    if outer is None or (scope is not None and scope.calls.get(outer.group) is outer):
        _release(call)
        return
    outer.parked.append((call, gathered if gathered is not None and call.tracked else None))


def _unpark(group: ParamGroup) -> tuple:
    """The parked call of `group` in the innermost open call, and its `_Gather` outputs, (None, None) if none;
    the other parked calls there are released: another module is gathering."""
    outer = _OPEN.stack[-1] if _OPEN.stack else None
    if outer is None or not outer.parked:
        return None, None
    found = (None, None)
    parked, outer.parked = outer.parked, []
    for call, gathered in parked:
        if call.group is group and not call.freed:
            found = (call, gathered if torch.is_grad_enabled() else None)
        else:
            _release(call)
    return found


def _flush(call: _Call) -> None:
    """Release the calls parked in `call`: its forward is over (or it is released itself). A gather it started
    ahead that no call took is finished and dropped: a later forward must not take it, its parameters
    gathered before the optimizer changed them (the module whose call came next in the last forward was not
    called in this one)."""
    parked, call.parked = call.parked, []
    for inner, _ in parked:
        _release(inner)
    ahead, call.prefetches = call.prefetches, []
    for started in ahead:
        st = _state(started.group)
        if st.get("prefetched") is started:
            del st["prefetched"]
            started.gather()
            started.free()
    call.entered.clear()


def _release(call: _Call) -> None:
    _flush(call)
    if call.frees_when_flushed:
        call.free()


_LIVE: "weakref.WeakSet[_Call]" = weakref.WeakSet()


def gathered_bytes() -> int:
    """Bytes this rank holds in gathered parameter copies right now (what ZeRO-3 frees between a
    module's forward and its backward; what ZeRO-2 keeps)."""
    rank = context.current().rank
    return sum(t.untyped_storage().nbytes() for call in list(_LIVE) if call.rank == rank and not call.freed
               for t, owned in zip(call.locals, call.owned) if owned)


def gathered_storages() -> set[int]:
    """Addresses of the storages this rank's gathered parameter copies live in (a saved view of one is
    a parameter, not an activation)."""
    rank = context.current().rank
    return {storage_key(t) for call in list(_LIVE) if call.rank == rank and not call.freed for t in call.locals}


def storage_key(t: torch.Tensor) -> int:
    """Which storage `t` lives in: its StorageImpl's address, which a meta tensor (data pointer 0) has too, so a dry
    run tells storages apart as a real run does."""
    return t.untyped_storage()._cdata


class _Gather(torch.autograd.Function):
    """Stored parameters -> compute layouts; backward: their gradients -> stored layouts."""

    @staticmethod
    def forward(ctx, call: _Call, *params: GlobalTensor) -> tuple:  # type: ignore[override]
        ctx.call = call
        call.tracked = True
        # an unused parameter's gradient stays None rather than autograd's plain zeros (`reduce_start` carries
        # only those that exist)
        ctx.set_materialize_grads(False)
        return _frozen_marked(ctx, tuple(call.gather()), params)

    @staticmethod
    def backward(ctx, *grads: Any) -> tuple:  # type: ignore[override]
        """Start the module's reduce-scatter and let the backward go on; the reduced gradients land in
        the parameters' `.grad` when the whole backward is done (as FSDP2 does), so the bucket's
        collective overlaps the rest of the backward where the backend allows (gloo)."""
        call = ctx.call
        call.leave_scope()
        scope = _SCOPES.get(context.current())
        if scope is not None and scope.calls.get(call.group) is call:  # reduced once, when the scope closes
            scope.add(call, grads)
            return (None,) * (1 + len(grads))
        # The module's backward is done: nothing gathered outlives it. Its copies are freed, and the next
        # module's prefetched gather is finished into that module's parameters (the all-gather's buffers, the
        # backend's copy among them, freed), before the reduction makes its buffers: else all of them are
        # held at once, the peak of the step (FSDP2 also reshards before its reduce-scatter).
        call.backward_done()
        _land_down_to(max(in_flight(call.group.params[0].device), 1) - 1)  # the previous buffers go first
        # left in flight at least until the next module's backward begins (`_Regather`): by then autograd has
        # dropped this call's gradients, which it holds until this function returns
        _LANDING.pending.append((call.group.params, call.reduce_start(grads)))
        _queue_landing()
        return (None,) * (1 + len(grads))


_GATHER_BACKWARD = _Gather._backward_cls


class _Release(torch.autograd.Function):
    """Identity on the inputs of a module whose parameters are all frozen: its backward is the end of the
    module's backward (the inputs' gradients are made), where `_Gather`'s would be: the gathered copies are
    freed and the next module's prefetched gather finished. Nothing is reduced."""

    @staticmethod
    def forward(ctx, call: _Call, *xs: torch.Tensor) -> tuple:  # type: ignore[override]
        ctx.call = call
        call.tracked = True
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: Any) -> tuple:  # type: ignore[override]
        call = ctx.call
        call.leave_scope()
        call.backward_done()
        return (None, *grads)


def _release_at_inputs(obj: Any, call: _Call) -> Any:
    """`obj` with its tensors that take a gradient passed through one `_Release` node for `call`."""
    marked = _taking_grad(obj)
    if not marked:
        return obj
    released = iter(_Release.apply(call, *marked))
    return map_tensors(lambda t: next(released) if t.requires_grad else t, obj)


def _taking_grad(obj: Any) -> list:
    """The tensors in `obj` that take a gradient, in `map_tensors`' order."""
    found: list = []

    def note(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            found.append(t)
        return t
    map_tensors(note, obj)
    return found


MAX_IN_FLIGHT: Optional[int] = None  # reduce-scatters left running while the backward goes on; None: `in_flight`


def in_flight(device: torch.device) -> int:
    """How many reduce-scatters stay in flight across a module's backward: FSDP2's choice per device. On a
    GPU one runs on its own stream beside the backward's kernels. On CPU the collective's copies compete
    with the backward for the same cores, and a bucket in flight only holds its buffers longer: FSDP2 runs
    it at once there. We land it when the next module's backward begins (after autograd has dropped the
    full-size gradients it was made from, which landing inside the reducing call would hold beside its
    buffers). Wide GPT on 4 gloo ranks: peak 1.08x FSDP2's with one in flight, 0.93x landed so
    (bench/RESULTS.md). `MAX_IN_FLIGHT` overrides it."""
    if MAX_IN_FLIGHT is not None:
        return MAX_IN_FLIGHT
    return 1 if device.type == "cuda" else 0


class _Accumulation:
    """What `accumulating()` keeps: per group that keeps its gathered parameters, the call whose shards
    every micro-batch uses, and the gradients summed over the micro-batches in the compute layouts."""

    def __init__(self) -> None:
        self.calls: dict = {}   # ParamGroup -> _Call
        self.grads: dict = {}   # _Call -> [gradient (compute layout) or None per parameter]
        # ParamGroup -> the gathered outputs every micro-batch takes (one `_Gather` node for the scope); held here,
        # not by the call, which the outputs' node holds (a cycle would keep a failed step's calls alive)
        self.outputs: dict = {}

    def add(self, call: "_Call", grads: tuple) -> None:
        have = self.grads.get(call)
        if have is None:
            self.grads[call] = list(grads)
            return
        for i, g in enumerate(grads):
            if g is not None:
                have[i] = g if have[i] is None else have[i] + g

    def close(self) -> None:
        """Reduce each group's summed gradients into the stored layouts (one bucket per group, in the
        order the groups were first called: the same on every rank) and free the gathered copies. The
        step is over: a Partial on an axis where the parameter is stored Broadcast is left for the step's
        gradient bucket (`_kept_partial`), as DDP leaves it (a tied weight's gradient too, sent back to
        its stage, where it joins the other use's gradient before the bucket reduces the sum)."""
        for group, call in self.calls.items():
            grads = self.grads.get(call)
            call.free()
            if grads is not None:
                call.reduced = True
                _land(group.params, call.reduce_start(tuple(grads), keep_partial=True))


_SCOPES: "weakref.WeakKeyDictionary[Any, _Accumulation]" = weakref.WeakKeyDictionary()  # per rank (communicator)


def kept_without_grads() -> list[ParamGroup]:
    """The groups this rank's `accumulating()` scope keeps gathered whose gathers took no gradient yet (in the
    order they were first called)."""
    scope = _SCOPES.get(context.current())
    if scope is None:
        return []
    return [group for group, call in scope.calls.items() if call not in scope.grads]


def add_kept_grads(group: ParamGroup, grads: tuple) -> None:
    """Gradients (in the compute layouts, None where none) for the gather of a group kept for this rank's
    `accumulating()` scope, as its backward would give them: summed with the others, reduced at the close."""
    scope = _SCOPES[context.current()]
    scope.add(scope.calls[group], grads)


@contextlib.contextmanager
def accumulating() -> Iterator[None]:
    """Micro-batches of one step: a module that keeps its gathered parameters
    (`reshard_after_forward=False`: ZeRO-2, or a tied weight used on another stage) gathers them once
    for all the micro-batches and reduces their summed gradients once, when the scope closes, instead
    of once per micro-batch (FSDP2's `set_requires_gradient_sync(False)` until the last micro-batch;
    Megatron's one all-reduce of the tied embedding's gradient per step). ZeRO-3 modules still gather
    per micro-batch (their memory bound is the point). Per rank; `gt.Pipeline.step` opens one."""
    comm = context.current()
    if comm in _SCOPES:
        yield
        return
    scope = _SCOPES[comm] = _Accumulation()
    try:
        yield
    finally:
        del _SCOPES[comm]
    scope.close()


class _Landing(threading.local):
    def __init__(self) -> None:
        self.pending: list = []   # (parameters, finisher of their reduction) in backward order
        self.queued = False
        self.entered: list = []   # calls whose backward began (`_Regather`) in this backward


def _queue_landing() -> None:
    if not _LANDING.queued:
        _LANDING.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(_land_gradients)


_LANDING = _Landing()


def _land_gradients() -> None:
    """End of a backward: wait for the reductions still in flight and accumulate them into `.grad`, as
    autograd's AccumulateGrad would have (so gradient accumulation over micro-batches works)."""
    pending, _LANDING.pending, _LANDING.queued = _LANDING.pending, [], False
    entered, _LANDING.entered = _LANDING.entered, []
    for params, finish in pending:
        _land(params, finish)
    # A module whose backward began but whose `_Gather` backward never ran: none of its trainable parameters
    # took a gradient (unused, or only its frozen ones read on the inputs' path). Its backward is over all the
    # same: it leaves the named scope and its copies are freed, as FSDP2's final callback runs the post-backward
    # of the groups whose hooks did not fire.
    scope = _SCOPES.get(context.current())
    for call in entered:
        if not call.reduced and not (scope is not None and scope.calls.get(call.group) is call):
            call.leave_scope()
            call.backward_done()


def _land_down_to(limit: int) -> None:
    """Land the oldest reductions in flight until at most `limit` are left."""
    while len(_LANDING.pending) > limit:
        _land(*_LANDING.pending.pop(0))


def _kept_partial(grad: Layout, stored: Layout) -> Layout:
    """Where a step's summed gradient (`_Accumulation.close`) lands: the stored layout, but Partial on an
    axis where the gradient is Partial and the parameter is stored Broadcast. The reduction there is an
    all-reduce of the parameter's whole size on that axis, which the step's gradient bucket (the
    optimizer's first read, `dispatch.defer_reduction`) makes anyway, in one collective with the other
    gradients; made here it is a collective of its own. Where the gradient goes to another placement (a
    tied weight's, back to its stage) it joins the gradient it meets there as a Partial (`_sum_layout`),
    reduced once with it (the planner moves it there as it is, each rank's share to its peer:
    `boxing/exchange.relocate`). An axis
    stored split (ZeRO) is reduce-scattered as before: the stored shard is what it is for."""
    if len(grad.sbp) != len(stored.sbp):
        return stored
    return Layout(stored.placement, tuple(g if _is_sum(g) and isinstance(s, Broadcast) else s
                                          for g, s in zip(grad.sbp, stored.sbp)))


def _is_sum(s: Any) -> bool:
    return isinstance(s, Partial) and s.op == "sum"


def _sum_layout(stored: Layout, a: Layout, b: Layout) -> Layout:
    """The layout two gradients of a parameter (stored in `stored`) are summed in: per mesh axis Partial
    where either is Partial (the sum is reduced once, by whoever reads it: never one operand first, nor the
    other made Partial-compatible by a gather), else the stored SBP (where the optimizer reads it). Each
    operand reaches it without moving anything wherever it is Broadcast, Partial or split as stored: e.g.
    an embedding's gradient whole on the tensor axis, (P, B), plus a vocab-split head's, (P, S(0)), is
    summed as (P, S(0)), the first sliced, rather than the second all-gathered to (P, B)."""
    return Layout(stored.placement, tuple(Partial() if _is_sum(x) or _is_sum(y) else s
                                          for s, x, y in zip(stored.sbp, a.sbp, b.sbp)))


def _land(params: tuple, finish: Any) -> None:
    """Reduced gradients into the parameters' `.grad`. Two of a parameter (a tied weight's, from its two
    uses) are summed in `_sum_layout`; a Partial result is noted for the step's gradient bucket, as the
    accumulation hook of a converted parameter notes it (module.py `_defer_grad_reduction`)."""
    with torch.no_grad():
        for p, g in zip(params, finish()):
            if g is None:
                continue
            have = p.grad
            if have is None:
                p.grad = g
            else:
                where = None
                if isinstance(have, GlobalTensor) and isinstance(g, GlobalTensor) and \
                        have._layout.placement == g._layout.placement == p._layout.placement:
                    where = _sum_layout(p._layout, have._layout, g._layout)
                if where is None or where == have._layout:
                    have.add_(g)
                else:
                    mine = dispatch.box(have._local, have._layout, where, tuple(p.shape))
                    if storage_key(mine) == storage_key(have._local):
                        mine = mine.clone()  # a slice of the old gradient: not kept alive whole
                    mine.add_(dispatch.box(g._local, g._layout, where, tuple(p.shape)))
                    p.grad = GlobalTensor(mine, where, tuple(p.shape))
            if isinstance(p.grad, GlobalTensor) and p.grad._layout.has_partial:
                dispatch.defer_reduction(p.grad, grad_layout(p.grad._layout), in_place=True)


class _Regather(torch.autograd.Function):
    """Identity on a gathering module's output whose backward runs before any of the module's own:
    ZeRO-3 gathers the parameters again there (the saved tensors read them), and the module's
    backward enters the named scope, where its parameters' Partial gradients are taken as they are
    (the module's reduce-scatter reduces them) instead of being reduced early by some op's choice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, call: _Call) -> torch.Tensor:  # type: ignore[override]
        ctx.call = call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Any) -> tuple:  # type: ignore[override]
        call = ctx.call
        _OPEN.ended = None  # a forward after this backward starts a new chain
        _land_down_to(in_flight(call.group.params[0].device))  # before this module's backward allocates
        call.regather()
        link, call.before_in_backward = call.before_in_backward, None
        nxt = link() if link is not None else None
        if nxt is not None:  # overlap the next module's gather with this module's backward (FSDP2's prefetch)
            nxt.prefetch_regather()
            call.prefetched = nxt  # finished when this module's backward is done (`_GatherBackward`)
        call.enter_scope()
        _LANDING.entered.append(call)
        _queue_landing()
        return grad, None


def _mark_outputs(output: Any, call: _Call) -> Any:
    return map_tensors(lambda t: _Regather.apply(t, call) if t.requires_grad else t, output)


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)


def compute_layout(stored: Layout, hint: tuple, placement: Optional[Any] = None) -> Layout:
    """The compute layout a `params=` hint gives a parameter stored in `stored` (None keeps an axis), on
    `placement` (default: the stored one; another one of the same mesh shape moves the parameter
    there while the module runs, and its gradient back: a tied weight used on another stage)."""
    return Layout(placement or stored.placement, tuple(s if h is None else h for h, s in zip(hint, stored.sbp)))
