"""Converting a single-device nn.Module: parameters and buffers become GlobalTensors in place.

`plan` maps name patterns (fnmatch globs, e.g. "*.mlp.fc.weight") to one of two
things; the first matching pattern of each kind wins:

- an nd-SBP, for the parameters and buffers whose names match (unmatched ones
  are Broadcast). A tensor reachable under several names (tied weights) is
  converted once, under its first name, and stays one Parameter.
- a `ModuleLayout`, for the submodules whose names match (the root is ""):
  the layouts its first input and its output are converted to,
  and the layouts their gradients take. This is how a user states activation
  layouts where the per-op choice should not decide them, as DTensor's
  `ColwiseParallel(input_layouts=, output_layouts=)` and OneFlow's
  `to_global(grad_sbp=)` do; e.g. Megatron's row-parallel output is
  `ModuleLayout(output=B)` (all-reduce forward) and its column-parallel input
  `ModuleLayout(input_grad=B)` (all-reduce of the input gradient backward).

Each converted parameter's gradient, once accumulated, is noted as pending (if Partial, or laid out
otherwise than its parameter) so that the optimizer's first read reduces (converts) all of them
together, one collective per bucket as DDP does, instead of one per parameter and read
(`dispatch.defer_reduction`).
"""
from __future__ import annotations

import fnmatch
import inspect
import threading
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Union

import torch

from ..layout import Layout, normalize_sbp
from ..ops import dispatch
from ..ops.scope import enter_named_here
from ..placement import Placement
from .experts import ExpertLocal
from .plain import PlainRegion, RowLocal, row_group_axes
from ..raggedtensor.ops import boundary_cut, convert as convert_ragged
from ..sbp import SBP_TYPES, Broadcast, Partial, Ragged, SbpLike, Split
from ..tensor import GlobalTensor, OnBackward, distribute
from .stage import StageForward, stage_hooks
from .zero import ParamGroup, compute_layout


@dataclass(frozen=True)
class ModuleLayout:
    """Layouts at a module's boundary and of its parameters while it runs; each an nd-SBP (one entry
    per mesh axis) or None (leave alone).

    `input`/`output`: the layout the module's first argument is converted to before `forward` (its first
    positional one; for a call with keywords alone, its forward's first parameter's: a transformers decoder layer
    calls `self_attn(hidden_states=...)`), and the layout its output is converted to after.
    `input_grad`/`output_grad`: the layout the gradient of that tensor is converted to in the backward (default:
    the dual of its forward layout, i.e. Partial -> Broadcast). An entry of None inside a tuple keeps that mesh
    axis as the tensor arrives (a tensor-parallel hint leaves the data axis alone), and a single
    SBP stands for a 1-D mesh's tuple. An `output` entry may be `gt.ragged(d)`: dim d cut as the
    module's input arrived cut on that axis (its ragged sizes, or a balanced split where it arrived
    split; whole where it arrived whole): MoE's experts hand their output back to the tokens' cut of the groups.

    `arg_grads`: {argument: layout of its gradient} for the module's other arguments, each named by its position
    in the forward's parameters (1 is the second; the first's is `input_grad`) or by its name, passed positionally
    or by keyword; the forward leaves them as they are. MoE's experts all-reduce the routing weights' gradient
    (their third argument) at their boundary, as Megatron and transformers' `MoeExpertsParallel` do:
    `arg_grads={2: B}`.

    `params`: the compute layout of the module's parameters (recursively, except those of
    submodules with their own `params`): stored as the plan's nd-SBP says, they take this layout
    while the module runs, gathered together, and their gradients come back to the stored layout
    together (ZeRO / FSDP: `globaltensor/parallel/zero.py`). `reshard_after_forward`: free the gathered
    copies after the forward and gather again for the backward (ZeRO-3), or keep them (ZeRO-2).
    `param_dtype`: the dtype they are gathered and used in (mixed precision; the module's floating
    inputs are cast to it); `reduce_dtype`: the dtype their gradients are reduced in.

    `row_local`: the module computes each row (dim 0) of its outputs from the same rows of its inputs
    alone (a token-wise MoE block with a dropless router), so on a batch split it runs on each rank's rows
    in plain torch, as DDP runs it, instead of as the global program it writes (a sort of every token):
    see `globaltensor/parallel/plain.py`'s `RowLocal`. A claim the values rely on, as DTensor's `local_map`.

    `expert_local`: the module is a routed experts module (`forward(x [T, d], index [T, k], weights [T, k])`,
    each output row the weighted sum of its k experts' functions of its row, expert e reading only entry e of
    each parameter [E, ...]: transformers' experts modules), its parameters split on dim 0 over one mesh axis
    (the expert axis): it runs as expert parallelism, each routed row sent to its expert's rank and its result
    back (`by_expert` / `by_group`, one all-to-all each way), the module's own forward run on each rank's rows
    with its experts: see `globaltensor/parallel/experts.py`. A claim the values rely on, as `row_local`.
    """
    input: Optional[SbpLike] = None
    input_grad: Optional[SbpLike] = None
    arg_grads: Optional[Mapping[Union[int, str], SbpLike]] = None
    output: Optional[SbpLike] = None
    output_grad: Optional[SbpLike] = None
    params: Union[SbpLike, Layout, None] = None
    reshard_after_forward: bool = True
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    row_local: bool = False
    expert_local: bool = False

    def __post_init__(self) -> None:
        if all(getattr(self, f) is None for f in ("input", "input_grad", "arg_grads", "output", "output_grad",
                                                  "params")) and not self.row_local and not self.expert_local:
            raise ValueError("ModuleLayout: give at least one of input, input_grad, arg_grads, output, output_grad, "
                             "params, row_local, expert_local")
        if self.arg_grads is not None:
            if not isinstance(self.arg_grads, Mapping) or not all(
                    isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and k >= 1)
                    for k in self.arg_grads):
                raise TypeError("ModuleLayout(arg_grads=): expected {argument position (1 on: the first argument's "
                                f"is input_grad) or name: gradient layout}}, got {self.arg_grads!r}")
            object.__setattr__(self, "arg_grads", tuple(sorted(self.arg_grads.items(), key=str)))
        for name in ("row_local", "expert_local"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModuleLayout({name}=): expected True or False, got {getattr(self, name)!r}")
        if self.row_local and self.expert_local:
            raise ValueError("ModuleLayout(row_local=True, expert_local=True): give one; row_local runs a module on "
                             "whole parameters, expert_local on its experts' slice of them")
        for name in ("param_dtype", "reduce_dtype"):
            d = getattr(self, name)
            if d is not None and (not isinstance(d, torch.dtype) or not d.is_floating_point):
                raise TypeError(f"ModuleLayout({name}=): {d!r} is not a floating dtype; give e.g. torch.bfloat16 "
                                "or None (keep the parameters' dtype)")
            if d is not None and self.params is None:
                raise ValueError(f"ModuleLayout({name}=): needs params= (the layout the parameters are used in, "
                                 "e.g. params=gt.broadcast)")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"ModuleLayout(reshard_after_forward=): expected True (ZeRO-3) or False (ZeRO-2), "
                            f"got {self.reshard_after_forward!r}")


def _hint(spec: Any, ndim: int, arg: str, ragged: bool = False) -> Optional[tuple]:
    """An nd-SBP whose entries may be None; checked against the mesh. `ragged`: an output's, which may
    name `gt.ragged(d)`: dim d cut on that axis as the module's input arrived cut (its sizes)."""
    if spec is None:
        return None
    if isinstance(spec, (tuple, list)) and any(s is None for s in spec):
        if len(spec) != ndim:
            raise ValueError(f"{arg}: has {len(spec)} entries but the placement mesh has {ndim} axes")
        for s in spec:
            if s is not None and not isinstance(s, SBP_TYPES + ((Ragged,) if ragged else ())):
                raise TypeError(f"{arg}: {s!r} is not an SBP; use gt.split(d), gt.broadcast, gt.partial(op) "
                                "or None (keep the axis)")
        return tuple(spec)
    return normalize_sbp(spec, ndim, arg)


@dataclass(frozen=True)
class _Boundary:
    """One tensor's conversion at a module boundary (checked hints, None entries still open)."""
    sbp: Optional[tuple]
    grad: Optional[tuple]
    where: str

    def apply(self, x: Any, arrived: Any = None) -> Any:
        """x laid out; a `gt.ragged(d)` entry takes the cut the module's input `arrived` in on that axis
        ((sbp, sizes, unit): its sizes where it was ragged, a balanced split where it was split)."""
        if not isinstance(x, GlobalTensor):
            raise TypeError(f"{self.where}: the plan lays out a GlobalTensor here, got {type(x).__name__}; "
                            "convert the model's inputs with gt.to_global first")
        hint, grad_hint = self.sbp, self.grad
        kept = row_group_axes()
        if kept is not None:  # inside a row-local module's row group: the hint's axes that its sub-mesh keeps
            hint = None if hint is None or len(hint) == x.placement.ndim else tuple(hint[a] for a in kept)
            grad_hint = None if grad_hint is None or len(grad_hint) == x.placement.ndim else \
                tuple(grad_hint[a] for a in kept)
        sbp = x.sbp if hint is None else tuple(o if h is None else h for h, o in zip(hint, x.sbp))
        try:
            x, sbp, sizes, unit = boundary_cut(x, sbp, hint, arrived)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{self.where}: {e}") from None
        grad = None
        if grad_hint is not None:
            dual = tuple(Broadcast() if isinstance(s, Partial) else s for s in sbp)
            grad = tuple(d if h is None else h for h, d in zip(grad_hint, dual))
        try:
            if sizes is not None:
                if grad is not None:
                    raise ValueError(f"gradient layout {grad} beside a ragged layout: a ragged tensor's gradient "
                                     "keeps its sizes; drop the gradient's hint")
                return convert_ragged(x, Layout(x.placement, sbp), sizes, unit)
            return x.to_global(x.placement, sbp, grad)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{self.where}: {e}") from None

    # the hooks are bound methods, not closures, so that a converted module pickles (torch.save(model))
    def before(self, module: torch.nn.Module, args: tuple) -> tuple:
        """Forward pre-hook: the first positional input laid out."""
        if not args:
            raise TypeError(f"{self.where}: the module was called without its first argument (positional, or "
                            "by its forward's first parameter's name)")
        return (self.apply(args[0]),) + tuple(args[1:])

    def after(self, module: torch.nn.Module, args: tuple, output: Any, arrived: Any = None) -> Any:
        """Forward hook: the output laid out."""
        return self.apply(output, arrived)


class _Armed(threading.local):
    def __init__(self) -> None:
        self.stack: list = []


_ARMED = _Armed()  # per thread (simulated rank): per open module call, whether it marked its backward and the
# cut its input arrived in ((sbp, sizes): what a ragged output hint takes)


@dataclass(frozen=True)
class _NamedModule:
    """A module whose boundary layouts the user named: convert them, and run its forward and backward in
    the named scope, where the cost model takes Partial outputs as the plan's (`ops/scope.py`)."""
    inp: Optional[_Boundary]
    out: Optional[_Boundary]
    more: tuple = ()  # ((argument position or name, _Boundary of its gradient), ...): ModuleLayout.arg_grads

    def __post_init__(self) -> None:
        # its number among the boundaries ever made (equal ones share one): under torch.compile the hooks hand
        # dynamo this int and run as an opaque call that AOTAutograd traces (`_compiled_before`)
        object.__setattr__(self, "_slot", _SLOTS.setdefault(self, len(_SLOTS)))
        _BY_SLOT[self._slot] = self

    def __reduce__(self):  # the slot is this process's: rebuilt (and numbered) where it is loaded
        return (_NamedModule, (self.inp, self.out, self.more))

    # bound methods, not closures, so that a converted module pickles (torch.save(model))
    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        """The module's first argument laid out: its first positional one, or, called with keywords alone (a
        transformers decoder layer calls `self_attn(hidden_states=...)`), its forward's first parameter's."""
        if self.more:
            args, kwargs = self._other_args(module, args, kwargs)
        key = _first_keyword(module, kwargs) if not args else None
        first = (kwargs[key],) if key is not None else args
        if torch.compiler.is_compiling():  # the opaque call takes tensors and constants only: not the other args
            first = _compiled_before(self._slot, first[:1]) + tuple(first[1:])
        else:
            first = self._before(first)
        return (args, {**kwargs, key: first[0]}) if key is not None else (first, kwargs)

    def _other_args(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        """`arg_grads`: the named arguments' gradients laid out, found by position or name in the forward's
        parameters whether the call passes them positionally or by keyword."""
        names = _forward_parameters(module)
        args, kwargs = list(args), dict(kwargs)
        for which, boundary in self.more:
            name = names[which] if isinstance(which, int) and which < len(names) else which
            at = names.index(name) if name in names else None
            on = args if at is not None and at < len(args) else kwargs if name in kwargs else None
            if on is None:
                continue  # not passed: its default, which has no gradient
            k = at if on is args else name
            x = on[k]
            if isinstance(x, GlobalTensor) and x.requires_grad and torch.is_grad_enabled():
                on[k] = _compiled_arg(boundary, x) if torch.compiler.is_compiling() else boundary.apply(x)
        return tuple(args), kwargs

    def after(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self._after(args, output)
        if isinstance(output, torch.Tensor):
            return _compiled_after(self._slot, output)
        # the opaque call takes tensors and constants only: an output's other leaves (an attention's None
        # weights, a cache object) stay outside it, and `_after` sees the output's tensors as one tuple (what it
        # reads of a pytree output: the first that needs a gradient)
        leaves, spec = torch.utils._pytree.tree_flatten(output)
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        for i, t in zip(at, _compiled_after(self._slot, tuple(leaves[i] for i in at))):
            leaves[i] = t
        return torch.utils._pytree.tree_unflatten(leaves, spec)

    def _before(self, args: tuple) -> tuple:
        module = None
        x = args[0] if args else None
        arrived = (x.sbp, getattr(x, "sizes", None), getattr(x, "_unit", None)) if isinstance(x, GlobalTensor) else None
        if self.inp is not None:
            args = self.inp.before(module, args)
        dispatch.enter_named()
        x = args[0] if args else None
        armed = isinstance(x, GlobalTensor) and x.requires_grad and torch.is_grad_enabled()
        _ARMED.stack.append((armed, arrived))
        # the module's backward ends at its input: leave the named scope there
        return (OnBackward.apply(x, dispatch.leave_named),) + tuple(args[1:]) if armed else args

    def _after(self, args: tuple, output: Any) -> Any:
        module = None
        dispatch.leave_named()
        armed, arrived = _ARMED.stack.pop() if _ARMED.stack else (False, None)
        if self.out is not None:
            output = self.out.after(module, args, output, arrived)
        if not torch.is_grad_enabled():
            return output
        # where the backward enters the module: its output's gradient, or, for a pytree of outputs (an attention's
        # (output, weights)), its first tensor's that needs one
        leaves, spec = torch.utils._pytree.tree_flatten(output)
        at = next((i for i, t in enumerate(leaves) if isinstance(t, GlobalTensor) and t.requires_grad), None)
        if at is not None:
            # an input that needs no gradient (an embedding's indices) marks no end: the module's backward is
            # the last of its branch, so the scope lasts until the backward ends
            leaves[at] = OnBackward.apply(leaves[at], dispatch.enter_named if armed else _named_until_backward_ends)
            output = leaves[at] if isinstance(output, GlobalTensor) else torch.utils._pytree.tree_unflatten(leaves,
                                                                                                             spec)
        return output


def _forward_parameters(module: torch.nn.Module) -> list:
    """The names of the parameters of `module`'s class's forward (after self; not *args,
    **kwargs): its class's, since a row-local or stage module's own `forward` is our wrapper."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read (a builtin's)
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _first_keyword(module: torch.nn.Module, kwargs: dict) -> Optional[str]:
    """The name of `module`'s forward's first parameter where `kwargs` passes it, else None."""
    names = _forward_parameters(module) if kwargs else []
    return names[0] if names and names[0] in kwargs else None


_SLOTS: dict = {}  # _NamedModule -> its slot
_BY_SLOT: dict = {}  # slot -> _NamedModule


@torch._dynamo.nonstrict_trace
def _compiled_before(slot: int, args: tuple) -> tuple:
    """A named module's pre-hook under torch.compile: dynamo leaves it opaque (its Python reads layouts, opens
    the named scope, marks the backward), AOTAutograd runs it at trace time, so its conversions are graph ops."""
    return _BY_SLOT[slot]._before(args)


@torch._dynamo.nonstrict_trace
def _compiled_arg(boundary: _Boundary, x: GlobalTensor) -> GlobalTensor:
    return boundary.apply(x)


@torch._dynamo.nonstrict_trace
def _compiled_after(slot: int, output: Any) -> Any:
    """A named module's forward hook under torch.compile (its output: a tensor or a tuple of tensors). The
    module's arguments are not passed: `_after` does not read them."""
    return _BY_SLOT[slot]._after((), output)


def _named_until_backward_ends() -> None:
    """Enter the named scope for the rest of this backward: autograd calls back at its end (on the thread that
    called `backward()`, which need not be the one running this node: the leave is this thread's)."""
    torch.autograd.Variable._execution_engine.queue_callback(enter_named_here())


def _layout_hooks(name: str, hint: ModuleLayout, ndim: int) -> tuple:
    where = f"to_global(plan[{name!r}])"
    if all(getattr(hint, f) is None for f in ("input", "input_grad", "arg_grads", "output", "output_grad")):
        return None, None  # only parameters: their group runs the module in the named scope (zero.py)
    inp = _Boundary(_hint(hint.input, ndim, f"{where}.input"), _hint(hint.input_grad, ndim, f"{where}.input_grad"),
                    f"{where} on the input")
    out = _Boundary(_hint(hint.output, ndim, f"{where}.output", ragged=True),
                    _hint(hint.output_grad, ndim, f"{where}.output_grad"), f"{where} on the output")
    more = tuple((k, _Boundary(None, _hint(v, ndim, f"{where}.arg_grads[{k!r}]"), f"{where} on argument {k!r}"))
                 for k, v in hint.arg_grads or ())
    for b in (inp, out, *(b for _, b in more)):
        if b.grad is not None and any(isinstance(s, Partial) and s.op != "sum" for s in b.grad):
            raise ValueError(f"{where}: a gradient cannot be laid out as {b.grad} (gradients add up)")
    named = _NamedModule(inp if inp.sbp is not None or inp.grad is not None else None,
                         out if out.sbp is not None or out.grad is not None else None, more)
    return named.before, named.after


def _defer_grad_reduction(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook; the guess: the optimizer reads the gradient with its parameter, so in the
    parameter's layout (an elementwise update takes its operands' common layout), or, for a parameter that is
    not global on the gradient's placement, with its Partial axes reduced. Where the gradient is Partial that is
    the bucket's reduction into the parameter's shard (a vocab-parallel embedding's gradient, Partial on the
    data axis and whole on the tensor axis: sliced to the parameter's rows, then all-reduced: half the bytes of
    reducing it whole); where it has no Partial axis it is a split the parameter does not have (an embedding's
    gradient split on the hidden dim when a step's tokens are fewer than its rows: their gradients exchanged,
    not the table's reduced). An optimizer reads the gradient several times (AdamW: three): converted once, at
    the first read, with the other pending gradients; a compiled step converts them before it (`settle_step`)."""
    g = param.grad
    if not isinstance(g, GlobalTensor):
        return
    lay = g._layout
    if isinstance(param, GlobalTensor) and lay.placement == param._layout.placement and not lay.zigzag_axes \
            and not param._layout.zigzag_axes:
        if lay != param._layout:
            dispatch.defer_reduction(g, param._layout, in_place=True)
    elif lay.has_partial:
        dispatch.defer_reduction(g, Layout(lay.placement, tuple(
            Broadcast() if isinstance(s, Partial) else s for s in lay.sbp)), in_place=True)


def _matched_hints(module: torch.nn.Module, plan: Mapping[str, Any]) -> dict:
    """{module: (name, pattern, ModuleLayout)}: per module the first pattern that matches it, where a
    pattern applies to the outermost modules it matches ("blocks.*" is each block, not also each
    block's layers, as FSDP wraps each block)."""
    out: dict = {}
    taken: dict[str, list] = {}  # pattern -> names of the modules it matched
    for prefix, mod in module.named_modules():
        for pattern, hint in plan.items():
            if not isinstance(hint, ModuleLayout) or not fnmatch.fnmatchcase(prefix, pattern):
                continue
            if any(m == "" or prefix.startswith(m + ".") for m in taken.get(pattern, ())):
                continue
            taken.setdefault(pattern, []).append(prefix)
            out.setdefault(mod, (prefix, pattern, hint))
            break
    return out


def _param_groups(module: torch.nn.Module, hints: dict, placement: Placement) -> dict:
    """{module: ParamGroup} for the modules whose hint names `params`: each gathers its parameters,
    recursively, except those under a submodule that gathers its own."""
    owners = {mod: (name, pattern, hint) for mod, (name, pattern, hint) in hints.items() if hint.params is not None}
    groups = {}
    for mod, (name, pattern, hint) in owners.items():
        where = f"to_global(plan[{pattern!r}].params)"
        if type(mod).forward is torch.nn.Module.forward:
            raise ValueError(f"to_global(plan[{pattern!r}]): module {name!r} ({type(mod).__name__}) is a container "
                             f"that is never called, so it would never gather its parameters; name its children "
                             f"instead, e.g. {name + '.*'!r}")
        target = None  # the compute placement: the stored one, or a Layout's (a tied weight used on another stage)
        if isinstance(hint.params, Layout):
            target = hint.params.placement
            spec: Any = hint.params.sbp
        else:
            spec = hint.params
        sbp = _hint(spec, placement.ndim, where)
        if any(isinstance(s, Partial) for s in sbp if s is not None):
            raise ValueError(f"{where}: parameters cannot be used Partial ({sbp}); give Broadcast or a split")
        params: list = []
        index: dict[int, int] = {}
        slots = []
        stack = [mod]
        while stack:  # the module's own parameters and those of submodules without their own group
            m = stack.pop()
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                if id(p) not in index:
                    index[id(p)] = len(params)
                    params.append(p)
                slots.append((m, pname, index[id(p)]))
            stack.extend(c for c in m.children() if c not in owners)
        compute = []
        for p in params:
            if target is not None and target.shape != p._layout.placement.shape:
                raise ValueError(f"{where}: the compute layout's mesh {target.shape} differs from the stored mesh "
                                 f"{p._layout.placement.shape} of a parameter of {name or 'the root module'!r}; a "
                                 "compute placement must have the stored mesh's shape (give an nd-SBP, e.g. "
                                 "gt.broadcast, to use the stored placement)")
            lay = compute_layout(p._layout, sbp, target)
            lay.check_shape(tuple(p.shape), f"{where} for a parameter of {name or 'the root module'!r}")
            compute.append(lay)
        if not params:  # every parameter belongs to a nested gathering module (ALBERT's shared layer groups)
            continue
        groups[mod] = ParamGroup(f"{where} on {name or 'the root module'!r}", tuple(params), tuple(slots),
                                 tuple(compute), hint.reshard_after_forward, hint.param_dtype, hint.reduce_dtype)
    return groups


def _layout_for(name: str, plan: Mapping[str, Any], placement: Placement, ndim: Optional[int] = None,
                buffer: bool = False) -> Layout:
    """The first matching entry: an nd-SBP on `placement`, or a `gt.Layout` with its own placement (a
    pipeline stage); unmatched tensors are Broadcast on `placement`.

    A wildcard entry lays out what it can, as FSDP2 shards what it can and leaves the rest whole:
    - it passes over a tensor of `ndim` dims it cannot split (`"*": S(0)`, ZeRO's plan, meets Gemma's
      0-dim `embed_scale`) to the next entry, or Broadcast;
    - it splits no buffer: a buffer keeps its entry's placement (a pipeline stage's) but is whole there.
      Buffers are state the forward reads whole (rotary frequencies, position ids, running statistics),
      and a gathering module gathers parameters only: a split `inv_freq` made every layer gather RoPE's
      `cos` and `sin` again, forward and backward (HF Llama under ZeRO-3: 1.07x the textbook bytes).
    A name given exactly is laid out as asked (and raises if it cannot be)."""
    for pattern, value in plan.items():
        if isinstance(value, ModuleLayout) or not fnmatch.fnmatchcase(name, pattern):
            continue
        layout = value if isinstance(value, Layout) else \
            Layout(placement, normalize_sbp(value, placement.ndim, f"to_global(plan[{pattern!r}])"))
        if pattern != name:
            if buffer:
                return Layout(layout.placement, tuple(Broadcast() for _ in layout.sbp))
            if ndim is not None and any(isinstance(s, (Split, Ragged)) and s.dim >= ndim for s in layout.sbp):
                continue
        return layout
    return Layout(placement, (Broadcast(),) * placement.ndim)


def _plain_candidates(groups: dict, stages: dict, hooks: dict) -> list:
    """The modules that may run their later calls on plain tensors (`globaltensor/parallel/plain.py`): each gathering
    module with nothing inside it that gathers, lays out or is a stage of its own (their hooks need
    GlobalTensors), and that is not a stage itself (whose forward is the stage's)."""
    out = []
    for mod in groups:
        inner = [m for m in mod.modules() if m is not mod]
        if mod not in stages and not any(m in groups or m in stages or m in hooks for m in inner):
            out.append(mod)
    return out


def _check_plan(module: torch.nn.Module, plan: Mapping[str, Any]) -> None:
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    modules = {n for n, _ in module.named_modules(remove_duplicate=False)}
    unused = [p for p, v in plan.items()
              if not any(fnmatch.fnmatchcase(n, p) for n in (modules if isinstance(v, ModuleLayout) else names))]
    if unused:
        raise ValueError(f"to_global(plan): patterns {unused} match no parameter or buffer (an nd-SBP) or "
                         f"no module (a ModuleLayout); parameter names look like {sorted(names)[:4]}, module "
                         f"names like {sorted(modules)[1:5]}")


def _check_tied(name: str, converted: GlobalTensor, plan: Mapping[str, Any], placement: Placement,
                first: str) -> None:
    """One tensor under two names (tied weights) is converted once, under the first; an entry naming another of its
    names exactly (no wildcard: a generic pattern like "*.weight" matching both is routine) that asks for another
    layout would be dropped unseen: an error instead."""
    if not any(pattern == name and not isinstance(v, ModuleLayout) for pattern, v in plan.items()):
        return
    asked = _layout_for(name, plan, placement)
    if asked != converted._layout:
        raise ValueError(f"to_global(plan): {name!r} is the same tensor as {first!r} (tied), which the plan lays out "
                         f"as {converted._layout}, but an entry for {name!r} asks for {asked}; give the tied names one "
                         f"layout, or untie them (models/gpt.py: GPTConfig(tied_head=False))")


# What `to_global(module, placement, plan)` accepts: parameter-name patterns to an SBP (or a Layout on
# another placement: a pipeline stage) and module-name patterns to a ModuleLayout (fnmatch patterns).
PlanLike = Mapping[str, Union[SbpLike, Layout, "ModuleLayout"]]


def repeated_blocks(module: torch.nn.Module) -> list[str]:
    """The children of every non-empty `nn.ModuleList`, as `name.*` patterns: a transformer's layers, the units
    FSDP wraps one by one."""
    return sorted({f"{name}.*" for name, m in module.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)})


def zero_stored(sbp: tuple, dims: int, axes: tuple) -> tuple:
    """A parameter's stored layout under ZeRO on the data `axes`: each of them that `sbp` leaves Broadcast splits
    the first dim no axis splits (tensor parallelism's split stays outermost: one all-gather gives it back); an
    axis that already splits (the experts under EP), or no dim left whole, keeps `sbp`'s."""
    out = list(sbp)
    taken = {getattr(s, "dim", None) for s in sbp}
    free = [d for d in range(dims) if d not in taken]
    for a in axes:
        if isinstance(out[a], Broadcast) and free:
            out[a] = Split(free[0])
    return tuple(out)


def zero_plan(module: torch.nn.Module, mesh: Placement, axis: int = 0, plan: Optional[Mapping[str, Any]] = None,
              units: Optional[list] = None, *, reshard_after_forward: bool = True,
              param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None) -> dict:
    """ZeRO (FSDP) on mesh axis `axis`, composed over `plan` (tensor or expert parallelism on the other axes, e.g.
    `gt.hf.tp_plan(model, axis=1)`; or none): the whole plan to pass to `to_global`.

    Each parameter is stored split over `axis` on the first dim `plan` leaves whole (a data split nested in the
    tensor split would not be one all-gather) and gathered to Broadcast on `axis` while its unit runs: the root
    and each of `units` (module-name patterns; default `repeated_blocks`: FSDP's per-layer wrapping), ZeRO-3 with
    `reshard_after_forward`, else ZeRO-2. A parameter `plan` already splits on `axis` (experts under EP), or
    with no dim left whole, keeps its layout. Returned whole rather than as a part to merge into `plan`: where
    ZeRO splits a parameter depends on where `plan` does, and a plan's first matching entry wins."""
    plan = dict(plan or {})
    if not isinstance(axis, int) or not 0 <= axis < mesh.ndim:
        raise ValueError(f"zero_plan(axis={axis!r}): the mesh has {mesh.ndim} axes; pass an axis in range({mesh.ndim})")
    out: dict = {}
    for name, p in module.named_parameters():
        given = _layout_for(name, plan, mesh, ndim=p.dim())
        sbp = zero_stored(given.sbp, p.dim(), (axis,))
        out[name] = sbp if given.placement == mesh else Layout(given.placement, sbp)
    use = tuple(Broadcast() if a == axis else None for a in range(mesh.ndim))
    gather = dict(params=use, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                  reduce_dtype=reduce_dtype)
    hints = {k: v for k, v in plan.items() if isinstance(v, ModuleLayout)}
    for unit in [""] + list(repeated_blocks(module) if units is None else units):
        hints[unit] = replace(hints[unit], **gather) if unit in hints else ModuleLayout(**gather)
    out.update(hints)
    return out


def module_to_global(module: torch.nn.Module, placement: Placement,
                     plan: Optional[PlanLike] = None) -> torch.nn.Module:
    """Convert `module` in place (and return it); values are unchanged, gradients arrive as GlobalTensors."""
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"to_global(plan): expected a dict {{name pattern: sbp or gt.ModuleLayout}}, "
                        f"got {type(plan).__name__}")
    plan = plan or {}
    _check_plan(module, plan)
    hints = _matched_hints(module, plan)
    hooks = {mod: _layout_hooks(pattern, hint, placement.ndim) for mod, (_, pattern, hint) in hints.items()}
    done: dict[int, torch.Tensor] = {}
    first_names: dict[int, str] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(mod, kind)
            for name, t in list(table.items()):
                if t is None:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                if id(t) in done:  # a tied tensor's other name: a layout the plan gives it must be the one it has
                    _check_tied(full, done[id(t)], plan, placement, first_names[id(t)])
                else:
                    first_names[id(t)] = full
                    layout = _layout_for(full, plan, placement, t.dim(), kind == "_buffers")
                    layout.check_shape(t.shape, f"to_global(plan) for {full!r}")
                    g = distribute(t, layout)
                    done[id(t)] = torch.nn.Parameter(g, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else g
                    if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                        done[id(t)].register_post_accumulate_grad_hook(_defer_grad_reduction)
                table[name] = done[id(t)]
    for mod in module.modules():  # a second conversion replaces the first one's layout hooks
        for handle in [*mod.__dict__.pop("_gt_layout_hooks", ()), *mod.__dict__.pop("_gt_stage_hooks", ())]:
            handle.remove()
        mod.__dict__.pop("_gt_gather_group", None)
        if isinstance(mod.__dict__.get("forward"), (StageForward, PlainRegion, RowLocal, ExpertLocal)):
            del mod.__dict__["forward"]
    groups = _param_groups(module, hints, placement)
    stages = stage_hooks(module, groups)
    for mod, where in stages.items():
        mod.__dict__["forward"] = StageForward(mod, where)
    rows = {mod: (pattern, hint) for mod, (_, pattern, hint) in hints.items() if hint.row_local or hint.expert_local}
    for mod in _plain_candidates(groups, stages, hooks):
        if mod not in rows:
            mod.__dict__["forward"] = PlainRegion(mod)
    for mod, (pattern, hint) in rows.items():
        what = "row_local" if hint.row_local else "expert_local"
        if mod in stages:
            raise ValueError(f"to_global(plan[{pattern!r}]): {what} on a pipeline stage's module; mark a module "
                             "inside the stage")
        mod.__dict__["forward"] = (RowLocal if hint.row_local else ExpertLocal)(mod, pattern)
    for mod in set(hooks) | set(groups) | set(stages):
        pre, post = hooks.get(mod, (None, None))
        handles = []

        if pre is not None:
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        if mod in groups:
            handles.append(mod.register_forward_pre_hook(groups[mod].before, with_kwargs=True))
            handles.append(mod.register_forward_hook(groups[mod].after))
            handles.append(mod.register_forward_hook(groups[mod].unwind, always_call=True))
            onto = {c.placement for c in groups[mod].compute}
            if pre is None and post is None and groups[mod].param_dtype is None and len(onto) == 1:
                mod.__dict__["_gt_gather_group"] = groups[mod]  # only gathers, onto one placement: may run plain there
        if post is not None:
            handles.append(mod.register_forward_hook(post))
        mod.__dict__["_gt_layout_hooks"] = handles
    return module
