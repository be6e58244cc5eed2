"""A pipeline stage: a module whose parameters are all used on one placement while the model's span several.

`to_global` installs a `StageForward` as such a module's `forward` (`stage_hooks` finds them): inputs from
elsewhere are sent to the stage's placement first (a stage boundary: point-to-point at the lower bound),
a stage of one rank runs on plain local tensors, and a rank outside the stage makes the empty output
directly once a step has shown it the layouts. `gt.Pipeline` opens and closes the stages' steps, so that
parameters take their gradients once per step rather than once per micro-batch.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import early_exit, replay
from ..layout import Layout
from ..placement import Placement
from ..runtime import context, fiber
from ..sbp import Broadcast
from ..tensor import FromLocal, GlobalTensor, OnBackward, grad_layout
from .local_call import Swap, call_local
from .trees import map_tensors, tensors
from .zero import kept_output, reinstall, runs_plain


class StageForward:
    """The forward of a module whose parameters are all used on one placement while the model's span
    several (a pipeline stage): GlobalTensor inputs from elsewhere are sent here first, keeping their
    SBP where the meshes match (a stage boundary: point-to-point at the lower bound).

    A rank outside the stage need not run the module's ops on empty shards: once a whole step has
    shown it the output's layout and the layouts the gradients of the inputs and parameters arrive in
    (decided by the ranks inside, which a boundary's backward must agree on), `promote_watched()` (called by
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
        self.empty_grads: Optional[dict] = None    # in a step, outside: id(parameter) -> (it, the layout its gradient takes)
        self._tables: Optional[list] = None  # (its modules' _parameters, _buffers) dicts: walked once, read each call
        self._step_params: Optional[tuple] = None  # in a step, outside: (parameters, those taking a gradient)
        self._step_splits: dict = {}  # ... and per call key, how their gradients split (`_empty_grads_split`)
        self._step_swaps: Optional[list] = None  # in a step, inside, plain: the swaps its first call made (`_swap_in`)
        self._empties: dict = {}  # outside: id(parameter) -> (it, the empty gradient it takes at each step's end)
        self._whole = Layout(placement, (Broadcast(),) * placement.ndim)  # a plain stage's outputs
        self._ranks: dict = {}  # rank -> whether the placement holds it
        self._empty_grads_before: dict = {}  # outside: the empty gradients its parameters took at the last step's end
        self.enters_inline = False  # whether a pipeline's fibers stop at the start of its calls (`stop_on_entry`)
        self.watch_draws = False  # whether its calls inside warn when they draw random numbers (a pipeline's first step)

    def open_step(self) -> None:
        self.leaves, self.empty_grads = {}, {}
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
        leaves, empty, self.leaves, self.empty_grads = self.leaves, self.empty_grads, None, None
        self._step_params, self._step_splits, self._step_swaps = None, {}, None
        if not flush or leaves is None:
            return
        with torch.no_grad():
            for p, leaf in leaves.values():
                g = leaf.grad
                if g is not None:
                    lay = p._layout
                    if not lay.has_partial and not lay.zigzag_axes and g.dtype is p.dtype:  # its own key
                        _accumulate(p, p.with_local(g))
                    else:
                        _accumulate(p, GlobalTensor(g, grad_layout(lay), tuple(p.shape)))
            if empty:
                self._empty_grads_before = dict(empty)
            empties = self._empties
            for p, (lay, shape, dtype) in empty.values():
                if p.grad is not None:
                    _accumulate(p, None)
                    continue
                # an empty shard holds nothing to change: the one made for the parameter serves every step
                had, empty = empties.get(id(p), (None, None))
                if had is not p or empty._layout is not lay or empty.dtype is not dtype:
                    empty = GlobalTensor(torch.empty((0,), dtype=dtype, device=p._local.device), lay, shape)
                    empties[id(p)] = (p, empty)
                _accumulate(p, empty)

    def give_empty_grads_as_before(self) -> None:
        """A rank outside that left the forward before calling this stage (`early_exit`): its parameters take
        the empty gradients they took at the last step's end, as if it had called it."""
        if self.empty_grads is not None and self._empty_grads_before:
            self.empty_grads.update(self._empty_grads_before)

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
            if self.empty_grads is not None and all(isinstance(q, torch.nn.Parameter) for q in params):
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
        found = tensors(args)
        if kwargs:
            tensors(kwargs, found)
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
        ins = tensors(args)
        if kwargs:
            tensors(kwargs, ins)
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
            if self.empty_grads is None:
                targets = from_ins + wanting
            else:  # the parameters' (empty) gradients come once, at the step's end
                n_in = len(from_ins)
                split = self._step_splits.get(key) if self._step_params is not None else None
                if split is None:
                    split = _empty_grads_split(wanting, grads[n_in:])
                    if self._step_params is not None:  # the same parameters at each call of this step
                        self._step_splits[key] = split
                self.empty_grads.update(split[2])
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
        if not self._runs_plain():
            return forward(self.module, *args, **kwargs)
        grad = torch.is_grad_enabled()
        out = call_local(self.module, self._swaps(), map_tensors(_plain_input, args, GlobalTensor, grad),
                         map_tensors(_plain_input, kwargs, GlobalTensor, grad) if kwargs else kwargs)
        return map_tensors(_as_global, out, torch.Tensor, self._whole)

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

    def promote_watched(self) -> None:
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
    """A `Swap` (`call_local`'s) per GlobalTensor parameter and buffer in the module's (parameters, buffers)
    `tables`; and whether every parameter is the same tensor at each call of a step (a stored
    `nn.Parameter`, or a gathered copy kept for the step). The plain tensor: the local tensor where no
    gradient is taken; a gathered copy's `to_local()`, whose gradient goes back through its gather; given
    `leaves` (a pipeline step), the step's plain leaf per parameter and per kept gathered copy, whose
    gradient the step hands on once (`StageForward.hand_on`, `close_step`)."""
    swaps, stored = [], True
    for params, buffers in tables:
        for name, t in params.items():
            if isinstance(t, GlobalTensor):
                kept = leaves is not None and not t.is_leaf and kept_output(t)
                stored = stored and (isinstance(t, torch.nn.Parameter) or kept)
                if not (grad and t.requires_grad):
                    swaps.append(Swap(params, name, t, t._local))
                elif leaves is None or not (t.is_leaf or kept):
                    swaps.append(Swap(params, name, t, None))
                else:
                    entry = leaves.get(id(t))  # by id: a tensor's __hash__ is a Python call
                    if entry is None:
                        entry = leaves[id(t)] = (t, t._local.detach().requires_grad_())
                    swaps.append(Swap(params, name, t, entry[1]))
        for name, t in buffers.items():
            if isinstance(t, GlobalTensor):
                swaps.append(Swap(buffers, name, t, None if grad and t.requires_grad else t._local))
    return swaps, stored


def _accumulate(p: torch.Tensor, grad: Optional[GlobalTensor]) -> None:
    """`grad` added into `p.grad` as autograd's AccumulateGrad does, then `p`'s post-accumulate hooks."""
    if grad is not None:
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)
    for hook in (p._post_accumulate_grad_hooks or {}).values():
        hook(p)


def _as_global(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A plain stage's output tensor in `layout` (a GlobalTensor it returned as it is)."""
    if isinstance(t, GlobalTensor):
        return t
    shape = tuple(t.shape)
    return _StageOutput.apply(t, layout, shape) if t.requires_grad else GlobalTensor(t, layout, shape)


class _StageOutput(FromLocal):
    """A plain stage's output as a GlobalTensor (`FromLocal`, whose backward it keeps), remembering the plain
    tensor it wraps: a stage that takes it as its input on the same rank runs on that tensor itself
    (`_plain_input`), so consecutive plain stages form one plain autograd graph, with no unwrapping node, nor
    a backward through the wrap and the unwrap, per boundary between them."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout, shape: tuple) -> GlobalTensor:  # type: ignore[override]
        ctx.local, ctx.version = local, local._version
        return FromLocal.forward(ctx, local, layout, shape)


_STAGE_OUTPUT = _StageOutput._backward_cls


def _plain_input(x: GlobalTensor, grad: bool) -> torch.Tensor:
    """x's local tensor, differentiable where `grad` and x takes a gradient: the plain tensor x wraps where
    x is a plain stage's output as it came (not written in place since, no hook on it: its gradient is the
    plain tensor's), else `x.to_local()`."""
    if not (grad and x.requires_grad):
        return x._local
    node = x.grad_fn
    if type(node) is _STAGE_OUTPUT and node.local._version == node.version and not x._backward_hooks \
            and not x.retains_grad:
        return node.local
    return x.to_local()


@dataclass(frozen=True, eq=False)
class _GradLayout:
    """Tensor hook: remember the layout a gradient arrives in (see `StageForward`)."""
    into: list
    index: int

    def __call__(self, grad: Any) -> None:
        if isinstance(grad, GlobalTensor):
            self.into[self.index] = (grad._layout, tuple(grad.shape), grad.dtype)


def _empty_grads_split(wanting: list, grads: tuple) -> tuple:
    """A rank outside a stage, in a step: of the parameters taking a gradient (`wanting`, their gradients'
    layouts `grads`), those whose empty gradient is given at the step's end ({id: (parameter, layout)}) and
    the others, wired into the output's backward (a gathered copy's gradient goes back through its gather):
    (wired, their layouts, empty)."""
    wired, layouts, empty = [], [], {}
    for q, g in zip(wanting, grads):
        if not q.is_leaf or g is None:
            wired.append(q)
            layouts.append(g)
        else:
            empty[id(q)] = (q, g)
    return wired, tuple(layouts), empty


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
    """`obj`'s GlobalTensors sent to `placement` (`obj` itself where none moves); with `side` (a pipeline
    fiber's crossing), marked so that the backward tells the fiber where the gradient crosses back (the
    receiving side sends it)."""
    return map_tensors(_move, obj, GlobalTensor, placement, side)


def _move(t: GlobalTensor, placement: Placement, side: Optional[bool]) -> GlobalTensor:
    here = t._layout.placement
    if here is placement or here == placement:
        return t
    sbp = t.sbp if here.shape == placement.shape else (Broadcast(),) * placement.ndim
    moved = t.to_global(placement, sbp)
    if side is not None and moved.requires_grad:
        # the gradient crosses back here: the sending side receives it (entering), the other leaves
        return OnBackward.apply(moved, functools.partial(fiber.cross, entering=not side))
    return moved


def stage_hooks(module: torch.nn.Module, groups: dict) -> dict:
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


