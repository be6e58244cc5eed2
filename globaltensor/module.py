"""Converting a single-device nn.Module: parameters and buffers become GlobalTensors in place.

`plan` maps name patterns (fnmatch globs, e.g. "*.mlp.fc.weight") to one of two
things; the first matching pattern of each kind wins:

- an nd-SBP, for the parameters and buffers whose names match (unmatched ones
  are Broadcast). A tensor reachable under several names (tied weights) is
  converted once, under its first name, and stays one Parameter.
- a `ModuleLayout`, for the submodules whose names match (the root is ""):
  the layouts its first positional input and its output are converted to,
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
import functools
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from . import early_exit, replay
from .layout import Layout, normalize_sbp
from .ops import dispatch
from .ops.scope import enter_named_here
from .placement import Placement
from .plain import PlainRegion
from .runtime import context, fiber
from .ragged import boundary_cut, convert as convert_ragged
from .sbp import SBP_TYPES, Broadcast, Partial, Ragged
from .tensor import GlobalTensor, _FromLocal, _wrap, distribute, grad_layout
from .zero import ParamGroup, compute_layout, kept_output, reinstall, runs_plain


@dataclass(frozen=True)
class ModuleLayout:
    """Layouts at a module's boundary and of its parameters while it runs; each an nd-SBP (one entry
    per mesh axis) or None (leave alone).

    `input`/`output`: the layout the module's first positional argument is converted to before
    `forward`, and the layout its output is converted to after. `input_grad`/`output_grad`: the
    layout the gradient of that tensor is converted to in the backward (default: the dual of its
    forward layout, i.e. Partial -> Broadcast). An entry of None inside a tuple keeps that mesh
    axis as the tensor arrives (a tensor-parallel hint leaves the data axis alone), and a single
    SBP stands for a 1-D mesh's tuple. An `output` entry may be `gt.ragged(d)`: dim d cut as the
    module's input arrived cut on that axis (its ragged sizes, or a balanced split where it arrived
    split): MoE's experts hand their output back to the tokens' cut of the groups.

    `params`: the compute layout of the module's parameters (recursively, except those of
    submodules with their own `params`): stored as the plan's nd-SBP says, they take this layout
    while the module runs, gathered together, and their gradients come back to the stored layout
    together (ZeRO / FSDP: `globaltensor/zero.py`). `reshard_after_forward`: free the gathered
    copies after the forward and gather again for the backward (ZeRO-3), or keep them (ZeRO-2).
    `param_dtype`: the dtype they are gathered and used in (mixed precision; the module's floating
    inputs are cast to it); `reduce_dtype`: the dtype their gradients are reduced in.
    """
    input: Any = None
    input_grad: Any = None
    output: Any = None
    output_grad: Any = None
    params: Any = None
    reshard_after_forward: bool = True
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        if all(getattr(self, f) is None for f in ("input", "input_grad", "output", "output_grad", "params")):
            raise ValueError("ModuleLayout: give at least one of input, input_grad, output, output_grad, params")
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
        sbp = x.sbp if self.sbp is None else tuple(o if h is None else h for h, o in zip(self.sbp, x.sbp))
        try:
            x, sbp, sizes, unit = boundary_cut(x, sbp, self.sbp, arrived)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{self.where}: {e}") from None
        grad = None
        if self.grad is not None:
            dual = tuple(Broadcast() if isinstance(s, Partial) else s for s in sbp)
            grad = tuple(d if h is None else h for h, d in zip(self.grad, dual))
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
            raise TypeError(f"{self.where}: the module was called without a positional input")
        return (self.apply(args[0]),) + tuple(args[1:])

    def after(self, module: torch.nn.Module, args: tuple, output: Any, arrived: Any = None) -> Any:
        """Forward hook: the output laid out."""
        return self.apply(output, arrived)


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls `then()` before the gradient goes on: marks where a module's
    backward begins or ends (the named scope), or where a gradient crosses a stage boundary (a
    pipeline fiber's stops), placed where the forward passed that point."""

    @staticmethod
    def forward(ctx, x: GlobalTensor, then: Callable[[], None]) -> GlobalTensor:  # type: ignore[override]
        ctx.then = then
        if type(x) is not GlobalTensor:  # a ragged or zigzag tensor carries more than its layout: its own view
            return x.view_as(x)
        # the same shard, layout and key as `x.view_as(x)` would give, without its dispatch (~0.1 ms; a
        # pipeline marks every crossing of every micro-batch)
        return _wrap(GlobalTensor, x._local.view_as(x._local), x._layout, x._key.shape, x._key)

    @staticmethod
    def backward(ctx, grad: Any) -> Any:  # type: ignore[override]
        ctx.then()
        return grad, None


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

    # bound methods, not closures, so that a converted module pickles (torch.save(model))
    def before(self, module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0] if args else None
        arrived = (x.sbp, getattr(x, "sizes", None), getattr(x, "_unit", None)) if isinstance(x, GlobalTensor) else None
        if self.inp is not None:
            args = self.inp.before(module, args)
        dispatch.enter_named()
        x = args[0] if args else None
        armed = isinstance(x, GlobalTensor) and x.requires_grad and torch.is_grad_enabled()
        _ARMED.stack.append((armed, arrived))
        # the module's backward ends at its input: leave the named scope there
        return (_OnBackward.apply(x, dispatch.leave_named),) + tuple(args[1:]) if armed else args

    def after(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        dispatch.leave_named()
        armed, arrived = _ARMED.stack.pop() if _ARMED.stack else (False, None)
        if self.out is not None:
            output = self.out.after(module, args, output, arrived)
        if isinstance(output, GlobalTensor) and output.requires_grad and torch.is_grad_enabled():
            # an input that needs no gradient (an embedding's indices) marks no end: the module's backward is
            # the last of its branch, so the scope lasts until the backward ends
            output = _OnBackward.apply(output, dispatch.enter_named if armed else _named_until_backward_ends)
        return output


def _named_until_backward_ends() -> None:
    """Enter the named scope for the rest of this backward: autograd calls back at its end (on the thread that
    called `backward()`, which need not be the one running this node: the leave is this thread's)."""
    torch.autograd.Variable._execution_engine.queue_callback(enter_named_here())


def _layout_hooks(name: str, hint: ModuleLayout, ndim: int) -> tuple:
    where = f"to_global(plan[{name!r}])"
    if all(getattr(hint, f) is None for f in ("input", "input_grad", "output", "output_grad")):
        return None, None  # only parameters: their group runs the module in the named scope (zero.py)
    inp = _Boundary(_hint(hint.input, ndim, f"{where}.input"), _hint(hint.input_grad, ndim, f"{where}.input_grad"),
                    f"{where} on the input")
    out = _Boundary(_hint(hint.output, ndim, f"{where}.output", ragged=True),
                    _hint(hint.output_grad, ndim, f"{where}.output_grad"), f"{where} on the output")
    for b in (inp, out):
        if b.grad is not None and any(isinstance(s, Partial) and s.op != "sum" for s in b.grad):
            raise ValueError(f"{where}: a gradient cannot be laid out as {b.grad} (gradients add up)")
    named = _NamedModule(inp if inp.sbp is not None or inp.grad is not None else None,
                         out if out.sbp is not None or out.grad is not None else None)
    return named.before, named.after


def _defer_grad_reduction(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook; the guess: the optimizer reads the gradient with its Partial axes reduced, or,
    where it has none but is laid out otherwise than its parameter, in the parameter's layout. The latter is
    where the backward chose a split the parameter does not have (an embedding's gradient split on the hidden
    dim when a step's tokens are fewer than its rows: their gradients exchanged, not the table's reduced), and
    an optimizer reads the gradient several times (AdamW: three): converted once, at the first read, with the
    other pending gradients."""
    g = param.grad
    if not isinstance(g, GlobalTensor):
        return
    lay = g._layout
    if lay.has_partial:
        dispatch.defer_reduction(g, Layout(lay.placement, tuple(
            Broadcast() if isinstance(s, Partial) else s for s in lay.sbp)), in_place=True)
    elif isinstance(param, GlobalTensor) and lay != param._layout and lay.placement == param._layout.placement \
            and not lay.zigzag_axes and not param._layout.zigzag_axes:
        dispatch.defer_reduction(g, param._layout, in_place=True)


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
        groups[mod] = ParamGroup(f"{where} on {name or 'the root module'!r}", tuple(params), tuple(slots),
                                 tuple(compute), hint.reshard_after_forward, hint.param_dtype, hint.reduce_dtype)
    return groups


def _layout_for(name: str, plan: Mapping[str, Any], placement: Placement) -> Layout:
    """The first matching entry: an nd-SBP on `placement`, or a `gt.Layout` with its own placement (a
    pipeline stage); unmatched tensors are Broadcast on `placement`."""
    for pattern, value in plan.items():
        if isinstance(value, Layout) and fnmatch.fnmatchcase(name, pattern):
            return value
        if not isinstance(value, ModuleLayout) and fnmatch.fnmatchcase(name, pattern):
            return Layout(placement, normalize_sbp(value, placement.ndim, f"to_global(plan[{pattern!r}])"))
    return Layout(placement, (Broadcast(),) * placement.ndim)


class _StageForward:
    """The forward of a module whose parameters are all used on one placement while the model's span
    several (a pipeline stage): GlobalTensor inputs from elsewhere are sent here first, keeping their
    SBP where the meshes match (a stage boundary: point-to-point at the lower bound).

    A rank outside the stage need not run the module's ops on empty shards: once a whole step has
    shown it the output's layout and the layouts the gradients of the inputs and parameters arrive in
    (decided by the ranks inside, which a boundary's backward must agree on), `settle()` (called by
    `gt.Pipeline` after each step) lets it make the empty output directly, connected to the inputs
    and parameters by autograd (`_Elsewhere`) so that the boundaries' backward runs here as inside.
    Installed as the module's `forward` attribute (the class's is untouched).

    Within a pipeline step (`open_step` .. `close_step`) the parameters take their gradients once per
    step rather than once per micro-batch: a one-rank stage runs every micro-batch on the same plain
    leaf per parameter, so autograd sums the micro-batches' gradients in plain torch, and a rank
    outside gives the parameters their empty gradients at the step's end. The sum is the same one
    autograd would have formed in the parameters' `.grad`, in the same order.
    """

    def __init__(self, module: torch.nn.Module, placement: Placement) -> None:
        self.module, self.placement = module, placement
        self.seen: dict = {}      # call key -> (output layout, shape, dtype, requires grad, gradient layouts)
        self.watching: dict = {}  # call key -> (output meta, gradient layouts recorded by hooks so far)
        self.plain: Optional[bool] = None  # whether it runs on plain tensors (see `_runs_plain`)
        self.leaves: Optional[dict] = None  # in a step, inside: id(parameter) -> (it, its plain leaf for the step)
        self.owed: Optional[dict] = None    # in a step, outside: id(parameter) -> (it, the layout its gradient takes)
        self._tables: Optional[list] = None  # (its modules' _parameters, _buffers) dicts: walked once, read each call
        self._step_params: Optional[tuple] = None  # in a step, outside: (parameters, those taking a gradient)
        self._step_splits: dict = {}  # ... and per call key, how their gradients split (`_owed_split`)
        self._step_swaps: Optional[list] = None  # in a step, inside, plain: the swaps its first call made (`_swap_in`)
        self._empties: dict = {}  # outside: id(parameter) -> (it, the empty gradient it takes at each step's end)
        self._whole = Layout(placement, (Broadcast(),) * placement.ndim)  # a plain stage's outputs
        self._ranks: dict = {}  # rank -> whether the placement holds it
        self._owed_before: dict = {}  # outside: the empty gradients its parameters took at the last step's end
        self.enters_inline = False  # whether a pipeline's fibers stop at the start of its calls (`stop_on_entry`)
        self.watch_draws = False  # whether its calls inside warn when they draw random numbers (a pipeline's first step)

    def open_step(self) -> None:
        self.leaves, self.owed = {}, {}
        self._step_params, self._step_splits, self._step_swaps = None, {}, None

    def hand_on(self) -> None:
        """Inside the step's `accumulating()` scope, after its micro-batches: the gathered copies kept for the step
        (a tied weight on this stage) hand their plain leaves' gradients, summed over the micro-batches, back
        through their gather once (whose reduction the scope's close runs), as each micro-batch's backward did."""
        leaves = self.leaves
        if not leaves:
            return
        kept = [(k, p, leaf) for k, (p, leaf) in leaves.items() if not p.is_leaf]
        for k, p, leaf in kept:
            del leaves[k]
            if leaf.grad is not None:
                torch.autograd.backward([p], [GlobalTensor(leaf.grad, grad_layout(p._layout), tuple(p.shape))])

    def close_step(self, flush: bool = True) -> None:
        """The step's gradients into the parameters' `.grad`, as autograd's accumulation would have
        left them (post-accumulate hooks included, once); `flush=False` drops them (a failed step)."""
        leaves, owed, self.leaves, self.owed = self.leaves, self.owed, None, None
        self._step_params, self._step_splits, self._step_swaps = None, {}, None
        if not flush or leaves is None:
            return
        with torch.no_grad():
            for p, leaf in leaves.values():
                g = leaf.grad
                if g is not None:
                    lay = p._layout
                    if not lay.has_partial and not lay.zigzag_axes and g.dtype is p.dtype:  # its own key
                        _accumulate(p, _wrap(GlobalTensor, g, lay, p._key.shape, p._key))
                    else:
                        _accumulate(p, GlobalTensor(g, grad_layout(lay), tuple(p.shape)))
            if owed:
                self._owed_before = dict(owed)
            empties = self._empties
            for p, (lay, shape, dtype) in owed.values():
                if p.grad is not None:
                    _accumulate(p, None)
                    continue
                # an empty shard holds nothing to change: the one made for the parameter serves every step
                had, empty = empties.get(id(p), (None, None))
                if had is not p or empty._layout is not lay or empty.dtype is not dtype:
                    empty = GlobalTensor(torch.empty((0,), dtype=dtype, device=p._local.device), lay, shape)
                    empties[id(p)] = (p, empty)
                _accumulate(p, empty)

    def owe_as_before(self) -> None:
        """A rank outside that left the forward before calling this stage (`early_exit`): its parameters take
        the empty gradients they took at the last step's end, as if it had called it."""
        if self.owed is not None and self._owed_before:
            self.owed.update(self._owed_before)

    def tables(self) -> list:
        """Each of the module's modules' parameter and buffer dicts (the same dict objects for the module's
        life; their entries are read at each call: a ZeRO gather swaps them)."""
        if self._tables is None:
            self._tables = [(mod._parameters, mod._buffers) for mod in self.module.modules()]
        return self._tables

    def parameters(self) -> list:
        """`module.parameters()` (each once) from the cached dicts: a stage called per micro-batch on the
        ranks outside it asks twice per call."""
        out = [t for params, _ in self.tables() for t in params.values() if t is not None]
        if len({id(t) for t in out}) < len(out):  # a weight tied inside the module: once
            seen: set = set()
            out = [t for t in out if not (id(t) in seen or seen.add(id(t)))]
        return out

    def _parameters_now(self) -> tuple:
        """(its parameters, those of them taking a gradient) as this call sees them: in a step, read once where
        its slots hold the stored parameters (a gathering module around or inside it puts a gathered copy, no
        `nn.Parameter`, in them at each call: read at each call there)."""
        got = self._step_params
        if got is None:
            params = self.parameters()
            got = (params, [q for q in params if isinstance(q, GlobalTensor) and q.requires_grad])
            if self.owed is not None and all(isinstance(q, torch.nn.Parameter) for q in params):
                self._step_params = got
        return got

    def _swaps(self) -> list:
        """This call's swaps of its parameters and buffers for plain tensors (`_swap_in`). In a step: the step's
        first call's, read again as long as each slot still holds the tensor it held then; made afresh at
        each call where a gathering module puts its gathered copies (no `nn.Parameter`) in the slots."""
        swaps = self._step_swaps
        if swaps is not None:
            for table, name, t, _ in swaps:
                if table.get(name) is not t:
                    break
            else:
                return swaps
        grad = torch.is_grad_enabled()
        swaps, stored = _swap_in(self.tables(), grad, self.leaves)
        if self.leaves is not None and grad and stored:
            self._step_swaps = swaps
        return swaps

    def _runs_plain(self) -> bool:
        """On a one-rank placement a GlobalTensor is its local tensor, whatever its SBP: a module whose
        parameters all live there and that names no layouts inside (no hints, no gathering) computes
        the same on the plain local tensors, without the dispatcher (a pipeline stage of one rank runs
        as fast as plain torch). A module that only gathers its parameters onto this placement (the
        tied head on the last stage) does too: its gathered copies are swapped for their local tensors
        as the parameters are. Decided at the first call, when every hook is installed."""
        if self.plain is None:
            self.plain = self.placement.size == 1 and not any(
                m.__dict__.get("_gt_layout_hooks") and _gathers_onto(m) != self.placement
                for m in self.module.modules())
            if self.plain:
                for m in self.module.modules():
                    if _gathers_onto(m) == self.placement:
                        runs_plain(m.__dict__["_gt_gather_group"])
        return self.plain

    def _side(self, args: tuple, kwargs: dict, rank: int) -> Optional[bool]:
        """In a pipeline fiber, whether `rank` receives (True) or sends (False) the inputs here; None where
        nothing crosses to or from it (or outside a fiber)."""
        if not fiber.in_fiber():
            return None
        here = self.placement
        inside = self._holds(rank)
        found = _tensors(args)
        if kwargs:
            _tensors(kwargs, found)
        for t in found:
            if isinstance(t, GlobalTensor):
                there = t._layout.placement
                if there is not here and there != here and (inside or rank in there):
                    return inside
        return None

    def _holds(self, rank: int) -> bool:
        """`rank in self.placement`, remembered per rank."""
        inside = self._ranks.get(rank)
        if inside is None:
            inside = self._ranks[rank] = rank in self.placement
        return inside

    def stop_on_entry(self) -> None:
        """A pipeline that runs its micro-batches as fibers stops them where they enter this module: before its
        forward pre-hooks (`enter` as the first of them) where it has any, else at the start of this call (a
        hook would forgo torch's fast call path for every call of the module, ~25 us each)."""
        module = self.module
        if "_gt_stage_hooks" in module.__dict__:
            return
        # asked again at each step: a pre-hook registered since (a `gt.comm_report()`'s) makes it a hook
        self.enters_inline = not module._forward_pre_hooks
        if not self.enters_inline:
            module.__dict__["_gt_stage_hooks"] = (
                module.register_forward_pre_hook(self.enter, prepend=True, with_kwargs=True),)

    def enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook, run before the module's other hooks (a ZeRO gather, a boundary's conversion,
        which belong to the chunk): a pipeline fiber entering this rank's chunk may stop here, its
        schedule running the chunk later."""
        side = self._side(args, kwargs, context.current().rank)
        if side is not None:
            _stop_at(side)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rank = context.current().rank
        side = self._side(args, kwargs, rank)  # marks the crossing for the backward's stops
        if side is not None and self.enters_inline:
            _stop_at(side)
        inside = self._holds(rank)
        leave = early_exit.CALLS.on and early_exit.note(self, inside)  # a pipeline's micro-batch forward
        args = _moved(args, self.placement, side)
        if kwargs:
            kwargs = _moved(kwargs, self.placement, side)
        forward = type(self.module).forward
        if inside:
            if self.watch_draws:
                return self._watching_draws(forward, args, kwargs)
            recorder = replay.RECORDING.recorder
            if recorder is not None:  # a pipeline records this rank's part (replay.py)
                return recorder.stage_call(self, functools.partial(self._inside, forward, args, kwargs), args, kwargs)
            return self._inside(forward, args, kwargs)
        ins = _tensors(args)
        if kwargs:
            _tensors(kwargs, ins)
        params, wanting = self._parameters_now()
        from_ins = [t for t in ins if isinstance(t, GlobalTensor) and t.requires_grad]
        key = tuple([(t._key if isinstance(t, GlobalTensor) else (tuple(t.shape), t.dtype), t.requires_grad)
                     for t in ins] + [torch.is_grad_enabled(), len(from_ins) + len(wanting)])
        meta = self.seen.get(key)
        if meta is None and leave:  # never seen whole: this call must run
            early_exit.missed()
            leave = False
        if meta is None:
            targets = from_ins + wanting
            out = forward(self.module, *args, **kwargs)
            if isinstance(out, GlobalTensor) and key not in self.watching:
                layouts: list = [None] * len(targets)
                self.watching[key] = ((out._layout, tuple(out.shape), out.dtype, out.requires_grad), layouts)
                for i, t in enumerate(targets):
                    t.register_hook(_GradLayout(layouts, i))
            return out
        if meta[3] and (from_ins or wanting) and torch.is_grad_enabled():
            grads = meta[4]
            if self.owed is None:
                targets = from_ins + wanting
            else:  # the parameters' (empty) gradients come once, at the step's end
                n_in = len(from_ins)
                split = self._step_splits.get(key) if self._step_params is not None else None
                if split is None:
                    split = _owed_split(wanting, grads[n_in:])
                    if self._step_params is not None:  # the same parameters at each call of this step
                        self._step_splits[key] = split
                self.owed.update(split[2])
                targets, grads = from_ins + split[0], grads[:n_in] + split[1]
            if targets and not early_exit.untouched():
                targets, grads = _past_elsewhere(targets, grads)
                if leave and any(g is not None for g in grads):  # the micro-batch's backward starts here
                    raise early_exit.LeftForward(targets, grads)
                return _Elsewhere.apply(meta[:4] + (grads,), *targets)
        if leave:  # no backward would start from here: the forward runs on
            early_exit.missed()
        device = ins[0].device if ins else None
        if meta[3]:
            # requiring grad as on the ranks inside (its parameters do): the ops after it, a stage boundary's
            # among them, must record their backward here too (the boundary's sends the gradient across)
            return _Cut.apply(meta, _anchor(device))
        return GlobalTensor(torch.empty((0,), dtype=meta[2], device=device), meta[0], meta[1])

    def _inside(self, forward: Any, args: tuple, kwargs: dict) -> Any:
        if self._runs_plain():
            return _plain_forward(self.module, forward, self._whole, args, kwargs, self._swaps())
        return forward(self.module, *args, **kwargs)

    def _watching_draws(self, forward: Any, args: tuple, kwargs: dict) -> Any:
        """The call, warning if it drew random numbers (a pipeline's first step asks): the ranks outside a stage
        never draw its numbers, so their generators fall behind one device's, and the stages after it draw other
        numbers than one device would (dropout). Said, not silently different; it is the only op a pipeline
        does not compute as one device."""
        generators = [torch.default_generator]
        if self.placement.device_type == "cuda" and torch.cuda.is_available():
            device = context.current().device_for("cuda")
            generators.append(torch.cuda.default_generators[device.index if device.index is not None
                                                            else torch.cuda.current_device()])
        before = [g.get_state() for g in generators]
        out = self._inside(forward, args, kwargs)
        if any(not torch.equal(b, g.get_state()) for b, g in zip(before, generators)):
            self.watch_draws = False  # once
            warnings.warn(
                f"gt.Pipeline: the stage module {type(self.module).__name__} drew random numbers in its forward on "
                f"rank {context.current().rank} (dropout?). The ranks outside a stage do not draw its numbers, so "
                f"their generators fall behind one device's, and the later stages draw other numbers than the "
                f"same program on one device would: training is sound (torch.pipelining's stages draw apart too), "
                f"but does not equal one device. Set the dropout to 0 where one-device equality matters",
                stacklevel=3)
        return out

    def settle(self) -> None:
        """After a step: what the watched calls showed is known; later calls like them skip the ops."""
        for key, (out, layouts) in self.watching.items():
            self.seen[key] = out + (tuple(layouts),)
        self.watching.clear()


def _stop_at(side: bool) -> None:
    """A pipeline fiber crossing into (`side`: receiving) or out of one of this rank's chunks: it may stop here."""
    fiber.cross(entering=side)
    reinstall()  # other fibers may have run the modules this one is inside (their slots are shared)


def _gathers_onto(module: torch.nn.Module) -> Optional[Placement]:
    """The one placement a module that only gathers its parameters computes them on (None for any other module)."""
    group = module.__dict__.get("_gt_gather_group")
    return group.compute[0].placement if group is not None else None


def _swap_in(tables: list, grad: bool, leaves: Optional[dict]) -> tuple[list, bool]:
    """(table, name, GlobalTensor, the plain tensor it is swapped for while a one-rank stage runs, or None for
    its `to_local()` made at each call) per GlobalTensor parameter and buffer in the module's (parameters,
    buffers) `tables`; and whether every parameter is the same tensor at each call of a step (a stored
    `nn.Parameter`, or a gathered copy kept for the step). The plain tensor: the local tensor where no
    gradient is taken; a gathered copy's `to_local()`, whose gradient goes back through its gather; given
    `leaves` (a pipeline step), the step's plain leaf per parameter and per kept gathered copy, whose
    gradient the step hands on once (`_StageForward.hand_on`, `close_step`)."""
    swaps, stored = [], True
    for params, buffers in tables:
        for name, t in params.items():
            if isinstance(t, GlobalTensor):
                kept = leaves is not None and not t.is_leaf and kept_output(t)
                stored = stored and (isinstance(t, torch.nn.Parameter) or kept)
                if not (grad and t.requires_grad):
                    swaps.append((params, name, t, t._local))
                elif leaves is None or not (t.is_leaf or kept):
                    swaps.append((params, name, t, None))
                else:
                    entry = leaves.get(id(t))  # by id: a tensor's __hash__ is a Python call
                    if entry is None:
                        entry = leaves[id(t)] = (t, t._local.detach().requires_grad_())
                    swaps.append((params, name, t, entry[1]))
        for name, t in buffers.items():
            if isinstance(t, GlobalTensor):
                swaps.append((buffers, name, t, None if grad and t.requires_grad else t._local))
    return swaps, stored


def _plain_forward(module: torch.nn.Module, forward: Any, layout: Layout, args: tuple, kwargs: dict,
                   swaps: list) -> Any:
    """`forward` on the local tensors of a one-rank placement: parameters and buffers swapped for their plain
    tensors while it runs (`swaps`, from `_swap_in`), outputs wrapped back in `layout`."""
    grad = torch.is_grad_enabled()
    for table, name, t, plain in swaps:
        table[name] = t.to_local() if plain is None else plain
    try:
        if kwargs:
            out = forward(module, *_as_local(args, grad), **_as_local(kwargs, grad))
        else:
            out = forward(module, *_as_local(args, grad))
    finally:
        for table, name, t, _ in swaps:
            table[name] = t
    return _as_global(out, layout)


def _accumulate(p: torch.Tensor, grad: Optional[GlobalTensor]) -> None:
    """`grad` added into `p.grad` as autograd's AccumulateGrad does, then `p`'s post-accumulate hooks."""
    if grad is not None:
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)
    for hook in (p._post_accumulate_grad_hooks or {}).values():
        hook(p)


def _as_local(obj: Any, grad: bool) -> Any:
    if isinstance(obj, GlobalTensor):
        return _plain_input(obj) if grad and obj.requires_grad else obj._local
    if isinstance(obj, (tuple, list)):
        return type(obj)(_as_local(o, grad) for o in obj)
    if isinstance(obj, dict):
        return {k: _as_local(v, grad) for k, v in obj.items()}
    return obj


def _as_global(obj: Any, layout: Layout) -> Any:
    if isinstance(obj, torch.Tensor) and not isinstance(obj, GlobalTensor):
        return _StageOutput.apply(obj, layout, tuple(obj.shape)) if obj.requires_grad else \
            GlobalTensor(obj, layout, tuple(obj.shape))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_as_global(o, layout) for o in obj)
    if isinstance(obj, dict):
        return {k: _as_global(v, layout) for k, v in obj.items()}
    return obj


class _StageOutput(_FromLocal):
    """A plain stage's output as a GlobalTensor (`_FromLocal`, whose backward it keeps), remembering the plain
    tensor it wraps: a stage that takes it as its input on the same rank runs on that tensor itself
    (`_plain_input`), so consecutive plain stages form one plain autograd graph, with no unwrapping node, nor
    a backward through the wrap and the unwrap, per boundary between them."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout, shape: tuple) -> GlobalTensor:  # type: ignore[override]
        ctx.local, ctx.version = local, local._version
        return _FromLocal.forward(ctx, local, layout, shape)


_STAGE_OUTPUT = _StageOutput._backward_cls


def _plain_input(x: GlobalTensor) -> torch.Tensor:
    """x's local tensor, differentiable: the plain tensor x wraps where x is a plain stage's output as it came
    (not written in place since, no hook on it: its gradient is the plain tensor's), else `x.to_local()`."""
    node = x.grad_fn
    if type(node) is _STAGE_OUTPUT and node.local._version == node.version and not x._backward_hooks \
            and not x.retains_grad:
        return node.local
    return x.to_local()


@dataclass(frozen=True, eq=False)
class _GradLayout:
    """Tensor hook: remember the layout a gradient arrives in (see `_StageForward`)."""
    into: list
    index: int

    def __call__(self, grad: Any) -> None:
        if isinstance(grad, GlobalTensor):
            self.into[self.index] = (grad._layout, tuple(grad.shape), grad.dtype)


def _tensors(obj: Any, into: Optional[list] = None) -> list:
    """The tensors in `obj` (nested tuples, lists, dicts), in order, appended to `into`."""
    out = [] if into is None else into
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _owed_split(wanting: list, grads: tuple) -> tuple:
    """A rank outside a stage, in a step: of the parameters taking a gradient (`wanting`, their gradients'
    layouts `grads`), those whose empty gradient is given at the step's end ({id: (parameter, layout)}) and
    the others, wired into the output's backward (a gathered copy's gradient goes back through its gather):
    (wired, their layouts, owed)."""
    wired, layouts, owed = [], [], {}
    for q, g in zip(wanting, grads):
        if not q.is_leaf or g is None:
            wired.append(q)
            layouts.append(g)
        else:
            owed[id(q)] = (q, g)
    return wired, tuple(layouts), owed


def _past_elsewhere(targets: list, grads: tuple) -> tuple[list, tuple]:
    """`_Elsewhere` outputs among the targets (an earlier stage outside this rank, its output as it came, taking
    a gradient) replaced by that node's inputs and their gradients' layouts: every gradient on the way is
    empty, and what reaches those inputs is the same, so a run of stages outside a rank is one node in its
    backward, not one per stage."""
    out_t, out_g = [], []
    for t, g in zip(targets, grads):
        node = t.grad_fn
        if g is not None and type(node) is _ELSEWHERE and not t._backward_hooks and not t.retains_grad:
            out_t.extend(node.inputs)
            out_g.extend(node.grads)
        else:
            out_t.append(t)
            out_g.append(g)
    return out_t, tuple(out_g)


class _Elsewhere(torch.autograd.Function):
    """A stage's output on a rank outside it: empty; its backward gives each input and parameter an
    empty gradient in the layout the ranks inside give it (None where they give none)."""

    @staticmethod
    def forward(ctx, meta: tuple, *inputs: GlobalTensor) -> GlobalTensor:  # type: ignore[override]
        ctx.grads, ctx.device, ctx.inputs = meta[4], inputs[0]._local.device, inputs
        return GlobalTensor(torch.empty((0,), dtype=meta[2], device=ctx.device), meta[0], meta[1])

    @staticmethod
    def backward(ctx, grad: Any) -> tuple:  # type: ignore[override]
        return (None, *[None if g is None else GlobalTensor(torch.empty((0,), dtype=g[2], device=ctx.device), g[0],
                                                            g[1]) for g in ctx.grads])


_ELSEWHERE = _Elsewhere._backward_cls


class _Cut(torch.autograd.Function):
    """A stage's output on a rank outside it whose backward hands nothing on: no input takes a gradient, or none
    carries anything of this rank's (a pipeline's micro-batch before this rank's first message). Where the
    backward ends, as at a leaf, but without a leaf's accumulation of an empty gradient (about 0.1 ms)."""

    @staticmethod
    def forward(ctx, meta: tuple, anchor: torch.Tensor) -> GlobalTensor:  # type: ignore[override]
        return GlobalTensor(torch.empty((0,), dtype=meta[2], device=anchor.device), meta[0], meta[1])

    @staticmethod
    def backward(ctx, grad: Any) -> tuple:  # type: ignore[override]
        return None, None


_ANCHORS: dict = {}  # device -> an empty plain tensor taking a gradient (never given one): what `_Cut` hangs on


def _anchor(device: Optional[torch.device]) -> torch.Tensor:
    anchor = _ANCHORS.get(device)
    if anchor is None:
        anchor = _ANCHORS[device] = torch.empty((0,), device=device, requires_grad=True)
    return anchor


def _moved(obj: Any, placement: Placement, side: Optional[bool] = None) -> Any:
    """`obj`'s tensors sent to `placement`; with `side` (a pipeline fiber's crossing), marked so that
    the backward tells the fiber where the gradient crosses back (the receiving side sends it)."""
    if isinstance(obj, GlobalTensor):
        here = obj._layout.placement
        if here is placement or here == placement:
            return obj
        sbp = obj.sbp if here.shape == placement.shape else (Broadcast(),) * placement.ndim
        moved = obj.to_global(placement, sbp)
        if side is not None and moved.requires_grad:
            # the gradient crosses back here: the sending side receives it (entering), the other leaves
            return _OnBackward.apply(moved, functools.partial(fiber.cross, entering=not side))
        return moved
    if isinstance(obj, (tuple, list)):  # the same container where nothing moved
        moved = [_moved(o, placement, side) for o in obj]
        for m, o in zip(moved, obj):
            if m is not o:
                return type(obj)(moved)
        return obj
    if isinstance(obj, dict):
        return {k: _moved(v, placement, side) for k, v in obj.items()} if obj else obj
    return obj


def _stage_hooks(module: torch.nn.Module, groups: dict) -> dict:
    """{module: its stage's placement} for the outermost modules whose parameters are used on one placement, when
    the model's span several; empty otherwise (no hook, no cost). A module that gathers its parameters
    uses them where its group's compute layouts are (a tied head on the last stage)."""
    used: dict = {}  # id(module) -> placements its parameters are used on
    def visit_used(mod: torch.nn.Module, override: Optional[Placement]) -> set:
        if mod in groups:
            targets = {c.placement for c in groups[mod].compute}
            override = next(iter(targets)) if len(targets) == 1 else override
        own = {override or q._layout.placement for q in mod._parameters.values() if isinstance(q, GlobalTensor)}
        for child in mod.children():
            own |= visit_used(child, override)
        used[id(mod)] = own
        return own
    visit_used(module, None)
    places = {mod: used[id(mod)] for mod in module.modules()}
    if len(places[module]) <= 1:
        return {}
    out = {}

    def visit(mod: torch.nn.Module) -> None:
        if len(places[mod]) == 1:
            out[mod] = next(iter(places[mod]))
            return
        for child in mod.children():
            visit(child)
    visit(module)
    return out


def _plain_candidates(groups: dict, stages: dict, hooks: dict) -> list:
    """The modules that may run their later calls on plain tensors (`globaltensor/plain.py`): each gathering
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


def module_to_global(module: torch.nn.Module, placement: Placement,
                     plan: Optional[Mapping[str, Any]] = None) -> torch.nn.Module:
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
                    layout = _layout_for(full, plan, placement)
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
        if isinstance(mod.__dict__.get("forward"), (_StageForward, PlainRegion)):
            del mod.__dict__["forward"]
    groups = _param_groups(module, hints, placement)
    stages = _stage_hooks(module, groups)
    for mod, where in stages.items():
        mod.__dict__["forward"] = _StageForward(mod, where)
    for mod in _plain_candidates(groups, stages, hooks):
        mod.__dict__["forward"] = PlainRegion(mod)
    for mod in set(hooks) | set(groups) | set(stages):
        pre, post = hooks.get(mod, (None, None))
        handles = []

        if pre is not None:
            handles.append(mod.register_forward_pre_hook(pre))
        if mod in groups:
            handles.append(mod.register_forward_pre_hook(groups[mod].before, with_kwargs=True))
            handles.append(mod.register_forward_hook(groups[mod].after))
            onto = {c.placement for c in groups[mod].compute}
            if pre is None and post is None and groups[mod].param_dtype is None and len(onto) == 1:
                mod.__dict__["_gt_gather_group"] = groups[mod]  # only gathers, onto one placement: may run plain there
        if post is not None:
            handles.append(mod.register_forward_hook(post))
        mod.__dict__["_gt_layout_hooks"] = handles
    return module
