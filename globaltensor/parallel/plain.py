"""Plain regions: a module whose every op is local runs its later calls on plain local tensors.

Why: the dispatcher costs tens of microseconds per op (a key, a cached program, a wrap), which a small
model's ~250 ops per step pay where FSDP2 and DDP compute on plain tensors. When a module's layouts make
every one of its ops a kernel on the local shards (a ZeRO block: the batch split, the gathered parameters
Broadcast), the dispatcher decides nothing that a plain run would not do: the same kernels on the same
shards. So the first call with a given key (the layouts, shapes and dtypes of its inputs and parameters)
runs through the dispatcher while its decisions are watched; if they were all local, later calls swap the
module's parameters and inputs for their local tensors, run the module's own forward in plain torch, and
wrap the outputs in the layouts the dispatcher gave them. That is DTensor's `to_local` / `from_local`
around a region, and FSDP2's compute on unsharded plain parameters, decided by the rules instead of by
a wrapper class.

What makes a call local (`_judge`), from its dispatcher decisions, the same on every rank:

- every op a kernel (no fallback, no decomposition), no input converted, no collective in the forward;
- no op that writes in place, none that draws random numbers (the dispatcher gives each shard its part
  of one global stream: their rules' hooks say so, as attention's does with dropout on);
- a rule's own `kernel` only where the rule says it computes what the plain op would (`Rule.plain_when`:
  a view's sizes; attention without a sequence split);
- no rank holds an empty shard of an input (a plain kernel on an empty shard may fail where the dispatcher
  skips it);
- per mesh axis, the outputs are all split/partial (each rank computed its own part) or all Broadcast with
  every input Broadcast (every rank computed the same); that says the gradients' layouts
  (`_plain_grad_layout`);
- the forward, run once more in plain torch on one rank's local shapes (its own shards or zeros), makes
  the same calls with the same arguments as the watched run made with the global ones (a view's sizes
  excepted, which must match the shard's shape; copies that only strides ask for aside). This catches a
  forward that reads a global size into a value (`x / x.size(0)`): in the plain run it would read the
  local one. (That run writes into no real tensor, but a forward with Python side effects, a call
  counter, sees one call more.)

A call runs through the dispatcher while a hook would see the region's tensors (a submodule's hook, a
global module hook, an open `gt.comm_report()`): hooks see GlobalTensors. So does a rank outside the
placement (it holds empty shards, and takes no part in the placement's collectives). The ranks of the
placement must take the same path, as they run the same program: the forward moves nothing either way,
but the dispatcher's backward may convert inside the module where the plain one converts only at its
boundary (a Partial output's gradient: the plain backward moves less, never more; tests/test_plain_regions.py).

Gradients: an input split on an axis takes its gradient split alike; a Broadcast input (a parameter) used
on an axis where the outputs are split takes a Partial gradient there, each rank's own contribution, as
the dispatcher's rules give it (ZeRO's reduce-scatter or the gradient bucket reduces it); an output's
gradient is converted to its forward layout's dual before the plain backward reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import threading

import numpy as np

from ..layout import Layout
from ..placement import Placement, placement as make_placement
from ..runtime import context
from ..runtime.trace import watching
from ..sbp import Broadcast, Partial, Split
from ..ops.keys import geometry_of
from ..tensor import GlobalTensor, distribute, grad_layout
from .local_call import Swap, call_local


@dataclass(frozen=True)
class _Verdict:
    """What the watched call showed: `plain`, and for a plain one the outputs' (layout, shape, geometry: the
    wrapper's strides and offset) per flattened output leaf, the gradient layout per input leaf and per parameter/buffer slot; else `why` not."""
    plain: bool
    why: str = ""
    members: frozenset = frozenset()
    outs: tuple = ()
    in_grads: tuple = ()
    slot_grads: tuple = ()


class _Call(NamedTuple):
    """One call of a region's module, as the key, the watch, the verdict, the shape check and the plain run
    read it: its inputs, flattened, and its parameter and buffer slots with what they hold at this call."""
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    leaves: list
    spec: Any
    slots: list    # (table, name) per parameter and buffer of the module's modules
    tensors: list  # what each slot holds

    def swaps(self, plains: list) -> list:
        """`call_local`'s swaps: each GlobalTensor slot for its plain tensor in `plains` (one per slot)."""
        return [Swap(table, name, t, p) for (table, name), t, p in zip(self.slots, self.tensors, plains)
                if isinstance(t, GlobalTensor)]


_NOT_KEYED = object()
MAX_KEYS = 64  # keys watched per module; later new ones run through the dispatcher
ENABLED = True  # False: every call through the dispatcher (A/B measurements, debugging a region)
_M = torch.nn.modules.module


def _global_hooks() -> tuple:
    return (_M._global_forward_pre_hooks, _M._global_forward_hooks, _M._global_backward_pre_hooks,
            _M._global_backward_hooks)


class PlainRegion:
    """Installed as a module's `forward` attribute (the class's is untouched): the first call per key is
    watched through the dispatcher, later ones run plain where the watch allowed it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.verdicts: dict = {}

    def __getstate__(self) -> dict:  # a pickled or deep-copied module watches its calls afresh
        return {"module": self.module, "verdicts": {}}

    def why(self) -> dict:
        """Per key seen, why the call is not plain ('' where it is)."""
        return {k: v.why for k, v in self.verdicts.items()}

    def _walk(self) -> Optional[list]:
        """(table, name) of every parameter and buffer of the module's modules, read afresh at each call (a
        submodule or parameter may be replaced or added; a ZeRO gather swaps the entries); None where a hook
        would see the region's tensors: a submodule's, or a global module hook (an open `gt.comm_report()`'s
        among them). Hooks see GlobalTensors, so such a call runs through the dispatcher."""
        slots = []
        for m in self.module.modules():
            if m is not self.module and (m._forward_pre_hooks or m._forward_hooks or m._backward_hooks
                                         or m._backward_pre_hooks):
                return None
            for table in (m._parameters, m._buffers):
                for name in table:
                    slots.append((table, name))
        return None if any(_global_hooks()) else slots

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        if torch.compiler.is_compiling():  # the dispatcher runs once, at trace time: nothing to save by going plain
            return forward(self.module, *args, **kwargs)
        slots = self._walk() if ENABLED else None
        if slots is None:
            return forward(self.module, *args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        call = _Call(self.module, args, kwargs, leaves, spec, slots, [table[name] for table, name in slots])
        key = _key(call)
        verdict = self.verdicts.get(key) if key is not _NOT_KEYED else _Verdict(False, "an argument is not hashable")
        if verdict is None:
            if len(self.verdicts) >= MAX_KEYS:  # shapes that change every call: watching would cost each one
                return forward(self.module, *args, **kwargs)
            out, verdict = _watched(call)
            self.verdicts[key] = verdict
            return out
        if not verdict.plain or context.current().rank not in verdict.members:  # outside: empty shards
            return forward(self.module, *args, **kwargs)
        return self._plain(verdict, call)

    def _plain(self, v: _Verdict, call: _Call) -> Any:
        """The call in plain torch: its inputs and slots as local tensors, its outputs in the watched layouts."""
        leaves, slot_tensors = call.leaves, call.tensors
        grad = torch.is_grad_enabled()
        ins = [i for i, x in enumerate(leaves) if isinstance(x, GlobalTensor)]
        local_leaves = list(leaves)
        locals_: list = [t._local if isinstance(t, GlobalTensor) else t for t in slot_tensors]
        if grad:  # the tensors that take gradients become plain through one autograd node
            tracked = [(x, g) for x, g in ((leaves[i], v.in_grads[k]) for k, i in enumerate(ins))
                       if x.requires_grad] + \
                      [(t, g) for t, g in zip(slot_tensors, v.slot_grads)
                       if isinstance(t, GlobalTensor) and t.requires_grad]
            plain = iter(_ToPlain.apply(tuple(g for _, g in tracked), *(t for t, _ in tracked)) if tracked else ())
            for i in ins:
                local_leaves[i] = next(plain) if leaves[i].requires_grad else leaves[i]._local
            for s, t in enumerate(slot_tensors):
                if isinstance(t, GlobalTensor) and t.requires_grad:
                    locals_[s] = next(plain)
        else:
            for i in ins:
                local_leaves[i] = leaves[i]._local
        args, kwargs = pytree.tree_unflatten(local_leaves, call.spec)
        out = call_local(call.module, call.swaps(locals_), args, kwargs)
        out_leaves, out_spec = pytree.tree_flatten(out)
        at = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
        if len(at) != len(v.outs):
            raise RuntimeError(f"{type(call.module).__name__}.forward returned {len(at)} tensors where its watched "
                               f"call with the same inputs returned {len(v.outs)}: a forward whose outputs depend on "
                               "values cannot run as a plain region")
        if grad and any(out_leaves[i].requires_grad for i in at):
            wrapped = _FromPlain.apply(v.outs, *(out_leaves[i] for i in at))
        else:
            wrapped = [GlobalTensor(out_leaves[i], lay, shape, geometry=at_)
                       for i, (lay, shape, at_) in zip(at, v.outs)]
        for i, w in zip(at, wrapped):
            out_leaves[i] = w
        return pytree.tree_unflatten(out_leaves, out_spec)


def _key(call: _Call) -> Any:
    parts: list = [call.spec, call.module.training, torch.is_grad_enabled(), tuple(name for _, name in call.slots)]
    for x in call.leaves:
        if isinstance(x, GlobalTensor):
            parts.append((x._key, x.requires_grad))
        elif isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        else:
            try:
                hash(x)
            except TypeError:
                return _NOT_KEYED
            parts.append((type(x), x))
    for t in call.tensors:
        parts.append((t._key, t.requires_grad) if isinstance(t, GlobalTensor) else
                     None if t is None else (tuple(t.shape), t.dtype, t.requires_grad))
    try:
        return tuple(parts)
    except TypeError:
        return _NOT_KEYED


class _ToPlain(torch.autograd.Function):
    """GlobalTensors -> their local tensors; backward: each plain gradient as a GlobalTensor in its layout."""

    @staticmethod
    def forward(ctx, grads: tuple, *tensors: GlobalTensor) -> tuple:  # type: ignore[override]
        ctx.grads, ctx.shapes = grads, [tuple(t.shape) for t in tensors]
        ctx.set_materialize_grads(False)  # a parameter the forward does not read: None, as on one device, not zeros
        return tuple(_alias(t._local) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Any) -> tuple:  # type: ignore[override]
        return (None, *[None if g is None else GlobalTensor(g, lay, shape)
                        for g, lay, shape in zip(grads, ctx.grads, ctx.shapes)])


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on `t`'s storage with a version counter of its own, as the dispatcher's kernels see a shard
    (under autograd): ZeRO-3 refills a freed gathered parameter in place before the backward reads what
    autograd saved of it, which a view of it would take for a modification."""
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                   t.size(), t.stride())


class _FromPlain(torch.autograd.Function):
    """Plain outputs -> GlobalTensors in the watched layouts; backward: each gradient converted to the dual
    layout, then its local tensor."""

    @staticmethod
    def forward(ctx, outs: tuple, *locals_: torch.Tensor) -> tuple:  # type: ignore[override]
        ctx.duals = [grad_layout(lay) for lay, _, _ in outs]
        ctx.set_materialize_grads(False)  # an output the loss does not use: None, not zeros of its global shape
        return tuple(GlobalTensor(t.view_as(t), lay, shape, geometry=at) for t, (lay, shape, at) in zip(locals_, outs))

    @staticmethod
    def backward(ctx, *grads: Any) -> tuple:  # type: ignore[override]
        out: list = [None]
        for g, dual in zip(grads, ctx.duals):
            if isinstance(g, GlobalTensor):
                if g._layout != dual:
                    g = g.to_global(dual.placement, dual.sbp)
                g = g._local
            out.append(g)
        return tuple(out)


# -- the watch -----------------------------------------------------------------------------------------------
class _Watch:
    """What the dispatcher decided for each op of the watched call: the calls and the first reason not."""

    def __init__(self) -> None:
        self.calls: list = []  # (func, non-tensor arguments or None where sized by a hook, global output
        #                        shapes, output layouts)
        self.why = ""

    def __call__(self, func: Any, args: tuple, kwargs: dict, dec: Any) -> None:
        if self.why:
            return
        self.why = _not_local(func, dec)
        if not self.why:
            rule = dec.rule
            sized = rule is not None and rule.kernel is not None  # its sizes are the shard's: compared by shape
            self.calls.append((func, None if sized else _values(args, kwargs), dec.out_shapes, dec.out_layouts))


def _not_local(func: Any, dec: Any) -> str:
    name = str(func)
    if dec is None:
        return f"{name} is steered by a step plan"
    if dec.kind != "kernel":
        return f"{name} is a {dec.kind}"
    if dec.boxes or dec.writeback:
        return f"{name} converts an input ({dec.sources} -> {dec.targets})"
    if dec.inplace:  # (the shape check runs the forward on real shards: it must not write into them)
        return f"{name} writes in place"
    rule = dec.rule
    if rule is not None and rule.kernel is not None and (
            rule.plain_when is None or not rule.plain_when(dec.ctx, dec.targets, dec.out_layouts)):
        return f"{name}'s local kernel must know where its shard sits"
    if dec.out_shapes is None:
        return f"{name}'s output shape depends on the values"
    return ""


def _values(args: tuple, kwargs: dict) -> tuple:
    """The non-tensor arguments (tensors and devices as their place), comparable."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (spec, tuple(None if isinstance(x, (torch.Tensor, torch.device)) else x for x in leaves))


def _watched(call: _Call) -> tuple:
    """The call through the dispatcher, watched; and the verdict."""
    watch = _Watch()
    with context.comm_log() as log, watching(watch):
        out = type(call.module).forward(call.module, *call.args, **call.kwargs)
    return out, _judge(call, watch, log, out)


def _judge(call: _Call, watch: _Watch, log: Any, out: Any) -> _Verdict:
    if watch.why:
        return _Verdict(False, watch.why)
    if log.events:
        return _Verdict(False, f"it communicates ({log.events[0].kind})")
    out_leaves = pytree.tree_leaves(out)
    outs = [o for o in out_leaves if isinstance(o, torch.Tensor)]
    if not outs or not all(isinstance(o, GlobalTensor) for o in outs):
        return _Verdict(False, "an output is not a GlobalTensor")
    ins = [x for x in call.leaves if isinstance(x, GlobalTensor)]
    tensors = ins + [t for t in call.tensors if isinstance(t, GlobalTensor)] + outs
    placement = outs[0].placement
    if any(t.placement != placement for t in tensors) or any(t._layout.zigzag_axes for t in tensors):
        return _Verdict(False, "its tensors are not all on one placement in plain splits")
    if any(math.prod(s) == 0 for x in ins for s in x._layout.local_shapes(tuple(x.shape))) and \
            any(x.numel() for x in ins):
        return _Verdict(False, "a rank holds an empty shard of an input")
    split_axes = []
    for a in range(placement.ndim):
        kinds = {type(o._layout.sbp[a]) for o in outs}
        if kinds <= {Split, Partial}:
            split_axes.append(True)
        elif kinds == {Broadcast} and all(isinstance(x._layout.sbp[a], Broadcast) for x in tensors):
            split_axes.append(False)
        else:
            return _Verdict(False, f"its outputs and inputs mix layouts on mesh axis {a}")
    why = _shape_check(call, watch, placement)
    if why:
        return _Verdict(False, why)
    return _Verdict(True, "", frozenset(placement.flat_ranks), tuple((o._layout, tuple(o.shape), o._key.geometry) for o in outs),
                    tuple(_plain_grad_layout(x._layout, split_axes) for x in ins),
                    tuple(_plain_grad_layout(t._layout, split_axes) if isinstance(t, GlobalTensor) else None
                          for t in call.tensors))


def _plain_grad_layout(lay: Layout, split_axes: list) -> Layout:
    """A split stays, a Partial's gradient is Broadcast, a Broadcast's is Partial where the outputs are split."""
    return Layout(lay.placement, tuple(
        s if isinstance(s, Split) else Broadcast() if isinstance(s, Partial) else Partial() if split else s
        for s, split in zip(lay.sbp, split_axes)))


_aten = torch.ops.aten
# calls that copy values or not as strides ask: a plain tensor is made contiguous where a GlobalTensor already
# is (its strides are always contiguous), so `.contiguous()` and `reshape` call a clone on one and not the other
_COPIES = frozenset({_aten.clone.default, _aten.detach.default, _aten.alias.default, _aten.lift_fresh.default})
_VIEWS = {_aten._unsafe_view.default: _aten.view.default, _aten._reshape_alias.default: _aten.view.default,
          _aten.reshape.default: _aten.view.default}


# -- the shape check-------------------------------------------------------------------------------------------
class _Calls(TorchDispatchMode):
    """The calls on tensors that stand for GlobalTensors (`derived`) and on what is computed from them: the
    calls the dispatcher would see (one on plain tensors alone it never sees)."""

    def __init__(self, stand_ins: list) -> None:
        super().__init__()
        self.derived = WeakIdKeyDictionary({t: True for t in stand_ins})  # weak: intermediates freed as it goes
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # a tensor subclass's own queries (prim.device)
            return out
        if any(t in self.derived for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            for o in outs:
                self.derived[o] = True
            self.calls.append((func, args, kwargs, [tuple(o.shape) for o in outs]))
        return out


def _shape_check(call: _Call, watch: _Watch, placement: Any) -> str:
    """The forward in plain torch on one rank's local shapes: the same calls as watched, the same arguments
    (sizes excepted, which must be the shard's). The rank: the one whose shards differ most from the whole,
    the same on every rank. Its inputs and parameters are this rank's own shards where they have that rank's
    shapes (an even split: nothing allocated but the forward's intermediates and what autograd saves of
    them, dropped when it returns), else zeros; real, contiguous tensors on the real device taking gradients
    where the real ones do, because a composite op picks its kernels by device, strides and grad mode
    (attention's fused CPU kernel, not meta's math path; a Linear's addmm on a contiguous input, mm and add
    on a broadcast one; CUDA's efficient attention computes its log-sum-exp only under autograd). torch's
    FakeTensorMode would allocate nothing, but its first use imports 67 MiB and 1.2 s of compiler modules.
    The forward writes in place into nothing (`_not_local`), and the random state is put back after it."""
    gts = [t for t in call.leaves + call.tensors if isinstance(t, GlobalTensor)]

    def differ(r: int) -> int:
        return sum(a != b for t in gts for a, b in zip(t._layout.local_shape(tuple(t.shape), r), t.shape))
    rank = max(placement.flat_ranks, key=lambda r: (differ(r), -r))

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, GlobalTensor):
            return t
        shape, local = t._layout.local_shape(tuple(t.shape), rank), t._local
        if tuple(local.shape) == shape and local.is_contiguous():
            x = local.detach()  # this rank's own shard has the shape (an even split): no copy
        else:
            x = torch.zeros(shape, dtype=t.dtype, device=t.device)
        # taking a gradient where the real one does: composites read it (attention computes its log-sum-exp)
        return x.requires_grad_() if t.requires_grad and x.is_floating_point() else x
    stand_ins = {id(t): stand_in(t) for t in call.leaves + call.tensors if isinstance(t, torch.Tensor)}
    mode = _Calls([stand_ins[id(t)] for t in gts])
    cuda = sorted({t.device.index or 0 for t in gts if t.device.type == "cuda"})
    try:
        args, kwargs = pytree.tree_unflatten([stand_ins.get(id(x), x) for x in call.leaves], call.spec)
        with torch.random.fork_rng(devices=cuda), mode:  # in the call's grad mode; the graph is dropped after
            call_local(call.module, call.swaps([stand_ins.get(id(t), t) for t in call.tensors]), args, kwargs)
    except Exception as e:  # noqa: BLE001 - any failure only means: not plain
        return f"its forward on one rank's shard shapes raised {type(e).__name__}: {e}"
    mode.calls = [c for c in mode.calls if c[0] not in _COPIES]
    watch.calls = [c for c in watch.calls if c[0] not in _COPIES]
    if len(mode.calls) != len(watch.calls):
        return f"its forward on one rank's shard shapes made {len(mode.calls)} calls, not {len(watch.calls)}"
    for (func, args, kwargs, shapes), (wfunc, values, out_shapes, out_layouts) in zip(mode.calls, watch.calls):
        if _VIEWS.get(func, func) is not _VIEWS.get(wfunc, wfunc):
            return f"its forward on one rank's shard shapes called {func} where the watched one called {wfunc}"
        if values is not None and _values(args, kwargs) != values:
            return f"{func}'s arguments depend on the sizes of split dims (a global size read into a value)"
        want = [lay.local_shape(shape, rank) for lay, shape in zip(out_layouts, out_shapes)
                if lay is not None and shape is not None]
        if [tuple(s) for s in shapes] != [tuple(s) for s in want]:
            return f"{func} makes shard shapes {shapes}, not its layout's {want}"
    return ""


# -- row-local modules: declared, not watched -------------------------------------------------------------------
class RowLocal:
    """A module declared row-local (`ModuleLayout(row_local=True)`): each row (dim 0) of its outputs is computed
    from the same rows of its inputs alone, so it runs on each rank's rows in plain torch.

    Why: a module can be row-local while its program is not. Hugging Face's MoE blocks sort the whole batch's
    tokens by expert and index them back: on a batch split the global program moves tokens between ranks
    (exactly, and dearly), where DDP runs each rank's own sort. The sort's result is the same either way only
    because each token's output is its own; the dispatcher cannot see that, the user can say it, as DTensor's
    `local_map` lets one say a function runs on the local shards. The values are one device's where the claim
    holds (a dropless router, no batch statistics); a router with a capacity per batch (Switch) is not row-local.

    Axes: those on which the first tensor input (with a dim) is split on dim 0 are the row axes; every input
    with as many rows is laid out split on dim 0 there (others whole), Broadcast on the other axes, and the
    module's parameters and buffers must be whole while it runs (`params=gt.broadcast` under ZeRO). Outputs
    come back split on dim 0 on the row axes, Broadcast on the others; their global rows are the local rows
    scaled as the input's (a [batch, seq, d] input's [batch * seq, e] router logits), which must be a
    balanced split (a batch that divides over the ranks). Gradients: inputs' alike; parameters' Partial on
    the row axes (each rank's rows' share), reduced as any (the bucket, ZeRO's reduce-scatter). Hooks inside
    the module see its plain tensors, as inside DTensor's `local_map`.
    """

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        leaves, spec = pytree.tree_flatten((args, kwargs))
        first = next((x for x in leaves if isinstance(x, GlobalTensor) and x.dim() >= 1), None)
        axes = () if first is None else tuple(a for a, s in enumerate(first.sbp) if s == Split(0))
        if not axes or context.current().rank not in first.placement.flat_ranks:
            return forward(self.module, *args, **kwargs)  # no rows split (or empty shards here): the dispatcher's
        placement, rows, rank = first.placement, first.shape[0], context.current().rank
        others = tuple(a for a in range(placement.ndim) if a not in axes)
        slots = [(t, n) for m in self.module.modules() for t in (m._parameters, m._buffers) for n in t
                 if t[n] is not None]
        if others and any(isinstance(x, GlobalTensor) and any(not isinstance(x.sbp[a], Broadcast) for a in others)
                          for x in leaves + [t[n] for t, n in slots]):
            return self._per_row_group(leaves, spec, slots, placement, axes, others, rank)

        def on(split: bool, grad: bool = False) -> Layout:
            row = Split(0) if split else Partial() if grad else Broadcast()
            return Layout(placement, tuple(row if a in axes else Broadcast() for a in range(placement.ndim)))
        where = f"to_global(plan[{self.name!r}]) row_local"
        for i, x in enumerate(leaves):  # a plain tensor is Broadcast: one with the batch's rows is cut to them too
            if type(x) is torch.Tensor and x.dim() >= 1 and x.shape[0] == rows:
                leaves[i] = distribute(x, on(False))
        ins = [i for i, x in enumerate(leaves) if isinstance(x, GlobalTensor)]
        for i in ins:
            x = leaves[i]
            if x.placement != placement:
                raise ValueError(f"{where}: input {i} is on {x.placement}, the first on {placement}")
            want = on(x.dim() >= 1 and x.shape[0] == rows)
            if x._layout != want:
                leaves[i] = x.to_global(placement, want.sbp)
        held = leaves[next(i for i in ins if leaves[i].dim() >= 1)]._local.shape[0]  # the first one's rows here
        if held == 0:
            raise RuntimeError(f"{where}: rank {rank} holds none of the input's {rows} rows; a row-local module "
                               "runs on each rank's rows: give every rank some (a batch of at least the ranks)")
        for table, name in slots:
            t = table[name]
            if isinstance(t, GlobalTensor) and (t.placement != placement or t._layout != on(False)):
                raise ValueError(f"{where}: {name!r} is laid out {t.sbp} on {t.placement} while the module runs; a "
                                 f"row-local module runs on whole parameters on the input's placement: give it "
                                 f"params=gt.broadcast (ZeRO gathers them) or lay them out Broadcast")
        tensors = [table[name] for table, name in slots]
        grad = torch.is_grad_enabled()
        # what takes a gradient becomes plain through one autograd node: a row input's gradient split alike, a
        # whole input's or parameter's Partial on the row axes (each rank's rows' share)
        tracked = {id(x): (x, on(x._layout == on(True), grad=True)) for x in
                   [leaves[i] for i in ins] + [t for t in tensors if isinstance(t, GlobalTensor)]
                   if grad and x.requires_grad}
        plain = dict(zip(tracked, _ToPlain.apply(tuple(g for _, g in tracked.values()),
                                                 *(x for x, _ in tracked.values())) if tracked else ()))
        local_leaves = [plain.get(id(x), x._local) if isinstance(x, GlobalTensor) else x for x in leaves]
        locals_ = [plain.get(id(t), t._local) if isinstance(t, GlobalTensor) else t for t in tensors]
        call_args, call_kwargs = pytree.tree_unflatten(local_leaves, spec)
        swaps = [Swap(table, name, t, p) for (table, name), t, p in zip(slots, tensors, locals_)
                 if isinstance(t, GlobalTensor)]
        out = call_local(self.module, swaps, call_args, call_kwargs)
        out_leaves, out_spec = pytree.tree_flatten(out)
        at = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
        outs = []
        for i in at:
            shape = self._global_shape(out_leaves[i], rows, held, on(True), rank, where)
            outs.append((on(True), shape, _geometry_like(out_leaves[i], shape)))
        if grad and any(out_leaves[i].requires_grad for i in at):
            wrapped = _FromPlain.apply(tuple(outs), *(out_leaves[i] for i in at))
        else:
            wrapped = [GlobalTensor(out_leaves[i], lay, shape, geometry=g) for i, (lay, shape, g) in zip(at, outs)]
        for i, w in zip(at, wrapped):
            out_leaves[i] = w
        return pytree.tree_unflatten(out_leaves, out_spec)

    def _per_row_group(self, leaves: list, spec: Any, slots: list, placement: Placement, axes: tuple,
                       others: tuple, rank: int) -> Any:
        """The module on this rank's rows as a global program over the other mesh axes: the ranks that hold the
        same rows (a data rank's tensor group) run it together on the sub-mesh of those axes, their parameters
        laid out there as on the whole mesh (a tensor-parallel expert's slice stays a slice). Megatron's DP x TP:
        each data rank's tokens go through the tensor group's experts, and no token crosses a data rank.
        Outputs and gradients come back as on the whole mesh: rows split on the row axes, the sub-mesh's layout
        on the others (Broadcast there: the one layout every group's own program is sure to agree on); a
        parameter's or a whole input's gradient Partial on the row axes, laid out on the others as the
        parameter is."""
        where = f"to_global(plan[{self.name!r}]) row_local"
        mesh = np.array(placement.ranks, dtype=object).reshape(placement.shape)
        coord = placement.coord(rank)
        mine = tuple(coord[a] if a in axes else slice(None) for a in range(placement.ndim))
        sub = make_placement(placement.device_type, mesh[mine].tolist())  # the ranks holding this rank's rows
        rows = next(x for x in leaves if isinstance(x, GlobalTensor) and x.dim() >= 1).shape[0]

        def row_layout(split: bool) -> Layout:  # the row axes' part of a layout; the others whole
            return Layout(placement, tuple((Split(0) if split else Broadcast()) if a in axes else Broadcast()
                                           for a in range(placement.ndim)))
        for i, x in enumerate(leaves):  # a plain tensor is Broadcast: one with the batch's rows is cut to them too
            if type(x) is torch.Tensor and x.dim() >= 1 and x.shape[0] == rows:
                leaves[i] = distribute(x, row_layout(False))
        pieces = []  # (slot in leaves or table, tensor, whether it is a row input)
        for i, x in enumerate(leaves):
            if isinstance(x, GlobalTensor):
                if x.placement != placement:
                    raise ValueError(f"{where}: input {i} is on {x.placement}, the module's rows on {placement}")
                row = x.dim() >= 1 and x.shape[0] == rows
                want = tuple((Split(0) if row else Broadcast()) if a in axes else s for a, s in enumerate(x.sbp))
                if x.sbp != want:
                    x = leaves[i] = x.to_global(placement, want)
                pieces.append((("leaf", i), x, row))
        for table, name in slots:
            t = table[name]
            if isinstance(t, GlobalTensor):
                if t.placement != placement or any(not isinstance(t.sbp[a], Broadcast) for a in axes):
                    raise ValueError(f"{where}: {name!r} is laid out {t.sbp} on {t.placement} while the module runs; "
                                     "a row-local module runs on parameters whole on the row axes of its input's "
                                     "placement (params=gt.broadcast under ZeRO)")
                pieces.append((("slot", table, name), t, False))
        subs = _ToRowGroup.apply(sub, axes, others, tuple((t, r) for _, t, r in pieces), *(t for _, t, _ in pieces))
        swaps = []  # the module's slots hold their row group's tensors while it runs
        for (slot, t, _), st in zip(pieces, subs):
            if slot[0] == "leaf":
                leaves[slot[1]] = st
            else:
                swaps.append(Swap(slot[1], slot[2], t, st))
        call_args, call_kwargs = pytree.tree_unflatten(leaves, spec)
        held = row_layout(True).local_shape((rows,), rank)[0]
        with _rows_of(others):
            out = call_local(self.module, swaps, call_args, call_kwargs)
        out_leaves, out_spec = pytree.tree_flatten(out)
        at = [i for i, o in enumerate(out_leaves) if isinstance(o, GlobalTensor)]
        if any(type(o) is torch.Tensor for o in out_leaves):
            raise RuntimeError(f"{where}: an output is a plain tensor; on a row group every output is global")
        shapes = [self._global_shape(out_leaves[i], rows, held, row_layout(True), rank, where) for i in at]
        # Broadcast on the sub-mesh: a layout every row group agrees on without asking (each group's program
        # is its own, its choices its rows'); an output left split there is gathered
        whole = [out_leaves[i] if all(isinstance(s, Broadcast) for s in out_leaves[i].sbp) else
                 out_leaves[i].to_global(sub, (Broadcast(),) * sub.ndim) for i in at]
        back = _FromRowGroup.apply(placement, axes, tuple(shapes), *whole)
        for i, w in zip(at, back):
            out_leaves[i] = w
        return pytree.tree_unflatten(out_leaves, out_spec)

    @staticmethod
    def _global_shape(t: torch.Tensor, rows: int, held: int, layout: Layout, rank: int, where: str) -> tuple:
        """The output's global shape: its local rows scaled as the input's were, checked to be this rank's
        balanced part of them (so every rank's claim agrees)."""
        if t.dim() == 0 or (t.shape[0] * rows) % held:
            raise RuntimeError(f"{where}: an output of shape {tuple(t.shape)} has no rows in proportion to the "
                               f"input's ({held} of {rows} here): the module is not row-local")
        shape = ((t.shape[0] * rows) // held,) + tuple(t.shape[1:])
        if layout.local_shape(shape, rank)[0] != t.shape[0]:
            raise RuntimeError(f"{where}: an output's {t.shape[0]} rows on rank {rank} are not its balanced part of "
                               f"{shape[0]}: a row-local module needs rows that divide alike over the ranks (a batch "
                               "that divides by the data ranks)")
        return shape


def _geometry_like(local: torch.Tensor, shape: tuple) -> Optional[tuple]:
    """The global output's strides as one device lays it out: its dims in the local output's memory order."""
    if local.is_contiguous():
        return None
    order = sorted(range(local.dim()), key=lambda d: (-local.stride(d), d))  # outermost dim first
    whole = torch.empty([shape[d] for d in order], device="meta").permute(sorted(range(local.dim()), key=order.index))
    return geometry_of(shape, whole.stride(), 0)


class _RowGroupAxes(threading.local):
    kept: Optional[tuple] = None


_ROW_GROUP = _RowGroupAxes()


class _rows_of:
    """While a row-local module runs on a row group: the whole mesh's axes its sub-mesh keeps, so a module plan's
    hint inside (an nd-SBP of the whole mesh) is read on the sub-mesh's axes (`row_group_axes`)."""

    def __init__(self, kept: tuple) -> None:
        self.kept, self.outer = kept, None

    def __enter__(self) -> None:
        self.outer, _ROW_GROUP.kept = _ROW_GROUP.kept, self.kept

    def __exit__(self, *exc: Any) -> None:
        _ROW_GROUP.kept = self.outer


def row_group_axes() -> Optional[tuple]:
    """The whole mesh's axes a row group's sub-mesh keeps, while a row-local module runs on one (else None)."""
    return _ROW_GROUP.kept


def _to_sub(x: GlobalTensor, sub: Placement, axes: tuple, others: tuple, rows_split: bool) -> GlobalTensor:
    """x's local shard as a GlobalTensor on the row group's sub-mesh: its global shape this group's rows (a row
    input) or whole, its layout its own on the kept axes."""
    whole_rows = Layout(x.placement, tuple((Split(0) if rows_split else Broadcast()) if a in axes else Broadcast()
                                           for a in range(x.placement.ndim)))
    shape = whole_rows.local_shape(tuple(x.shape), context.current().rank)
    return GlobalTensor(_alias(x._local), Layout(sub, tuple(x.sbp[a] for a in others)), shape)


class _ToRowGroup(torch.autograd.Function):
    """Whole-mesh tensors -> the row group's; backward: each sub-mesh gradient as a whole-mesh one, split on
    the row axes (a row input's) or Partial there (a parameter's, a whole input's: this group's share)."""

    @staticmethod
    def forward(ctx, sub, axes, others, kinds, *tensors):  # type: ignore[override]
        ctx.axes, ctx.others = axes, others
        subs = tuple(_to_sub(t, sub, axes, others, row) for t, (_, row) in zip(tensors, kinds))
        ctx.kinds = [(t.placement, tuple(t.shape), row, s._layout) for (t, row), s in zip(kinds, subs)]
        ctx.set_materialize_grads(False)
        return subs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        out = []
        for g, (placement, shape, row, sub) in zip(grads, ctx.kinds):
            if g is None:
                out.append(None)
                continue
            if g._layout != grad_layout(sub):  # each row group's program is its own (its rows' routing): the
                g = g.to_global(sub.placement, grad_layout(sub).sbp)  # gradient laid out as every group lays it
            sbp, at = [None] * placement.ndim, iter(g.sbp)
            for a in range(placement.ndim):
                sbp[a] = (Split(0) if row else Partial()) if a in ctx.axes else next(at)
            out.append(GlobalTensor(g._local, Layout(placement, tuple(sbp)), shape))
        return (None,) * 4 + tuple(out)


class _FromRowGroup(torch.autograd.Function):
    """The row group's outputs -> whole-mesh tensors, rows split on the row axes; backward: each gradient split
    so on the row axes (its other axes as they arrive), its local shard the sub-mesh gradient's."""

    @staticmethod
    def forward(ctx, placement, axes, shapes, *outs):  # type: ignore[override]
        ctx.placement, ctx.axes = placement, axes
        ctx.subs = [(o.placement, tuple(o.shape)) for o in outs]
        ctx.set_materialize_grads(False)
        made = []
        for o, shape in zip(outs, shapes):
            at, sbp = iter(o.sbp), []
            for a in range(placement.ndim):
                sbp.append(Split(0) if a in axes else next(at))
            made.append(GlobalTensor(o._local.view_as(o._local), Layout(placement, tuple(sbp)), shape))
        return tuple(made)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        out = []
        for g, (sub, shape) in zip(grads, ctx.subs):
            if g is None:
                out.append(None)
                continue
            want = tuple(Split(0) if a in ctx.axes else s for a, s in enumerate(g.sbp))
            if g.sbp != want:
                g = g.to_global(ctx.placement, want)
            out.append(GlobalTensor(g._local, Layout(sub, tuple(s for a, s in enumerate(g.sbp) if a not in ctx.axes)),
                                    shape))
        return (None, None, None) + tuple(out)
