"""Deciding one call: which nd signature, so which layouts the inputs are boxed to and the outputs take.

A rule lists 1-D signatures per mesh axis; an nd signature picks one per axis.
The chosen one costs least, where the cost of a choice is everything it makes
the program pay: the boxing of its inputs, plus what its outputs still owe.
A Partial output owes its cheapest reduction (making an output Partial is
never free: it only moves the collective later, often onto a bigger tensor),
and an in-place op owes the boxing of its result back into its target's
layout (so it may compute where its operands are, the ZeRO update: on the
`S(0)` shard, then one all-gather of the new parameter). Cost is time under
the link model in force (`runtime/topology.py`): per rank, its received bytes
times the beta of the link they cross plus its shards' FLOPs at the compute
rate (`ops/flops.py`), the slowest rank's, plus an alpha per collective
launch; ties then break on bytes and collectives as before. A choice that
boxes nothing and owes nothing is taken without weighing the rest.

An op without a rule, or whose meta kernel cannot say its output shapes
(data-dependent), or for which no signature checks out, falls back: every
input Broadcast, run replicated, outputs Broadcast. That too is a decision,
run by the same program (`ops/program.py`).

A call with ragged inputs (`gt.ragged(d)`: rows cut unevenly, their sizes data) is decided here
too, on balanced stand-ins, among the choices that move no data (`RaggedRows`); the ragged
wing runs it on the true shards.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from .. import boxing
from ..layout import Layout
from ..runtime.topology import in_force, on_change
from ..sbp import Broadcast, Partial, Ragged, Split
from . import flops
from .errors import data_dependent, kernel_error
from .keys import geometry_of, meta_of
from .registry import RULES, Ctx, ShardSite, Rule, is_inplace
from .scope import excused, grad_sink
from .span import placement_of

MAX_COMBOS = 4096  # nd signatures scored per decision (only on a cache miss): 3-axis meshes stay cheap


@dataclass(frozen=True)
class RaggedRows:
    """Where a call's rows are cut unevenly (its ragged inputs): the decision reads them as the balanced
    split (the stand-in) and takes only what moves no data, since conversions and kernels' boxes assume
    balanced shards. On the ragged mesh axes the ragged inputs keep their split, a whole (Broadcast)
    operand may be cut along a dim as long as the rows (each rank's rows: a local slice), and the outputs
    carry the rows (a split of a dim as long as theirs, alike on every ragged axis), are Partial (each
    rank's rows a term) or Broadcast (what the rule computes whole from any shard); on every other axis
    every input stays as it is; a kernel that communicates itself is not taken. Such a choice holds for
    any cut of the rows, not only the balanced one."""
    axes: tuple      # the mesh axes that cut the rows
    holders: tuple   # per tensor slot: whether it holds the rows (is ragged)
    length: int      # the rows' dim's length

    @staticmethod
    def of(layouts: tuple, tensors: list) -> Optional["RaggedRows"]:
        """The rows of a call whose tensors arrive in `layouts`; None where none is ragged."""
        first = next((i for i, lay in enumerate(layouts) if lay.ragged_axes), None)
        if first is None:
            return None
        axes = layouts[first].ragged_axes
        return RaggedRows(axes, tuple(bool(lay.ragged_axes) for lay in layouts),
                          tensors[first].shape[layouts[first].sbp[axes[0]].dim])

    @staticmethod
    def stand_in(layout: Layout) -> Layout:
        """The balanced split a ragged layout is decided as."""
        return Layout(layout.placement, tuple(Split(s.dim) if isinstance(s, Ragged) else s for s in layout.sbp))

    def admits(self, ins: tuple, outs: tuple, axis: int, srcs: tuple, ctx: Ctx) -> bool:
        """Whether mesh axis `axis`'s 1-D signature moves no data (see the class)."""
        ragged = axis in self.axes
        for want, src, holds, shape in zip(ins, srcs, self.holders, ctx.shapes):
            have = src.sbp[axis]
            if not (want == have and (not ragged or holds or isinstance(have, Broadcast)) or
                    ragged and isinstance(have, Broadcast) and isinstance(want, Split) and
                    shape[want.dim] == self.length):
                return False
        if not ragged:
            return True
        return all(o is None or shape is None or isinstance(o, (Partial, Broadcast)) or
                   isinstance(o, Split) and shape[o.dim] == self.length for o, shape in zip(outs, ctx.out_shapes))

    def carried_alike(self, out_layouts: tuple) -> bool:
        """Whether each output's rows pass through on every ragged axis alike, or on none."""
        return all(lay is None or not any(isinstance(lay.sbp[a], Split) for a in self.axes) or
                   all(isinstance(lay.sbp[a], Split) and lay.sbp[a].dim == lay.sbp[self.axes[0]].dim
                       for a in self.axes) for lay in out_layouts)


@dataclass(frozen=True)
class Decision:
    kind: str                         # "kernel", "decompose" or "fallback"
    rule: Optional[Rule]
    ctx: Optional[Ctx]
    placement: Any
    sources: tuple                    # per tensor slot: the layout it arrives in
    targets: tuple                    # per tensor slot: the layout it is boxed to
    out_layouts: tuple                # per flattened output (None for a None output)
    out_shapes: Optional[tuple]       # per flattened output; None: known only after running (data-dependent)
    out_dtypes: tuple                 # per flattened output
    inplace: bool
    writeback: bool                   # in-place op computed elsewhere and boxed back into its target
    rows: Optional[RaggedRows] = None  # ragged inputs: sources and targets are balanced stand-ins
    # per flattened output: the (strides, storage offset) one device gives it (`keys.geometry_of`, None:
    # contiguous), from the op's meta kernel on stand-ins with the inputs' own; None where not known
    out_geometry: Optional[tuple] = None

    @property
    def boxes(self) -> bool:
        """Whether some input needs boxing."""
        return any(s != t for s, t in zip(self.sources, self.targets))


def meta_like(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=t.dtype, device="meta")


def map_tensors(args: tuple, kwargs: dict, fn: Callable) -> tuple[tuple, dict]:
    """Rebuild args/kwargs with every tensor (also inside lists) replaced by fn(tensor, slot index).

    A module-level walk, not a recursive inner function: such a function's closure refers to itself, a
    reference cycle that kept `fn` (and the op's tensors it holds) alive until the cyclic gc ran: a
    training step's first-call tensors outlived it (wide GPT ZeRO-3 peak 1.02x FSDP2's where 0.92x)."""
    count = [0]
    return tuple(_mapped(a, fn, count) for a in args), {k: _mapped(v, fn, count) for k, v in kwargs.items()}


def _mapped(a: Any, fn: Callable, count: list) -> Any:
    if isinstance(a, torch.Tensor):
        count[0] += 1
        return fn(a, count[0] - 1)
    if isinstance(a, (list, tuple)):
        return type(a)(_mapped(x, fn, count) for x in a)
    return a


def flatten_out(out: Any) -> tuple[list, Callable[[list], Any]]:
    """An op's tensor outputs as a list, and how to put a list of the same length back in their place."""
    if isinstance(out, torch.Tensor):
        return [out], lambda xs: xs[0]
    if isinstance(out, (tuple, list)):
        kind = type(out)
        if all(o is None or isinstance(o, torch.Tensor) for o in out):
            return list(out), lambda xs: kind(xs)
        # tensors beside plain values (flash attention's max lengths): the tensors in order, the values kept
        at = [i for i, o in enumerate(out) if o is None or isinstance(o, torch.Tensor)]
        if at:
            def put_back(xs: list) -> Any:
                items = list(out)
                for i, x in zip(at, xs):
                    items[i] = x
                return kind(items)
            return [out[i] for i in at], put_back
    return [], lambda xs: out


def decide(func: Any, args: tuple, kwargs: dict, tensors: list, cls: type,
           forced: Optional[tuple] = None) -> Decision:
    """The decision for this call; `tensors` are its tensor arguments in order (GlobalTensor or plain).

    `forced`: (targets, out_layouts) chosen beforehand for this call (a step plan, `ops/step_plan.py`),
    taken if the rule's kernel accepts it for these shapes; None if it does not (the caller decides again).
    """
    call = _start(func, args, kwargs, tensors, cls)
    if isinstance(call, Decision):
        return call
    ctx, rule, placement, srcs, outs, inplace, rows = call
    if forced is not None:
        if any(lay.placement != placement for lay in forced[0]) or not valid(ctx, rule, *forced, placement):
            return None  # type: ignore[return-value]
        chosen = forced
    else:
        chosen = _choose(call, tensors)
    if chosen is None:
        return _fallback(func, placement, srcs, outs, inplace, rows)
    targets, out_layouts = chosen
    return Decision("kernel", rule, ctx, placement, srcs, targets, out_layouts, ctx.out_shapes,
                    tuple(None if o is None else o.dtype for o in outs), inplace,
                    _writes_back(inplace, srcs, targets, out_layouts), rows, ctx.out_geometry)


def options(func: Any, args: tuple, kwargs: dict, tensors: list, cls: type) -> Optional[tuple]:
    """Every valid choice of this call, for a step plan to weigh against the rest of the step:
    (ctx, source layouts, [(targets, out_layouts), ...]); None where the call is not a kernel decision
    (a decomposition, a fallback: nothing to choose)."""
    call = _start(func, args, kwargs, tensors, cls)
    if isinstance(call, Decision):
        return None
    ctx, rule, placement, srcs, outs, inplace, _ = call
    found = [c for c in _laid(call, tensors)
             if signature_cost(ctx, srcs, tensors, *c, outs, inplace)[0] != float("inf")
             and valid(ctx, rule, *c, placement)]
    return (ctx, srcs, found) if found else None


class Call(NamedTuple):
    """What choosing a signature for one call needs."""
    ctx: Ctx
    rule: Rule
    placement: Any
    srcs: tuple                   # per tensor slot: the layout it arrives in (ragged ones: their stand-ins)
    outs: list                    # the meta outputs
    inplace: bool
    rows: Optional[RaggedRows]    # where ragged inputs cut the rows; None: none is ragged


def _start(func: Any, args: tuple, kwargs: dict, tensors: list, cls: type) -> Any:
    """Either the decision already (decomposition, fallback) or what choosing a signature needs (`Call`)."""
    rule = RULES.get(func)
    inplace = is_inplace(func)
    decomposes = rule is not None and rule.decompose is not None and rule.decompose_when is None
    # a decomposition's own calls check their placements: a foreach op's lists may span several (one per
    # pipeline stage: each index is one parameter's, on its stage)
    placement = (next(t._layout.placement for t in tensors if isinstance(t, cls)) if decomposes else
                 placement_of(func, tensors, cls))
    bcast = Layout(placement, (Broadcast(),) * placement.ndim)
    srcs = tuple(t._layout if isinstance(t, cls) else bcast for t in tensors)
    rows = RaggedRows.of(srcs, tensors)
    if rows is not None:
        srcs = tuple(RaggedRows.stand_in(lay) for lay in srcs)
    if decomposes:
        return Decision("decompose", rule, None, placement, srcs, srcs, (), None, (), inplace, False, rows)
    try:
        # stand-ins with the inputs' strides and offsets: the outputs' strides are one device's
        meta_args, meta_kwargs = map_tensors(args, kwargs, lambda t, i: meta_of(t))
        outs, _ = flatten_out(func(*meta_args, **meta_kwargs) if rule is None or rule.meta is None else
                              rule.meta(func, meta_args, meta_kwargs))
    except Exception as e:
        if not data_dependent(e):  # a wrong call (shapes that do not fit): the kernel's error, at once
            raise kernel_error(func, e, tensors, cls) from None
        outs = None  # no meta kernel (data-dependent output): only a replicated run can say
    if outs is None and rule is not None and rule.decompose is not None:  # e.g. x[mask]: a mask to indices
        return Decision("decompose", rule, None, placement, srcs, srcs, (), None, (), inplace, False, rows)
    geometry = None if outs is None else _geometry(func, rule, outs, meta_args, meta_kwargs)
    if outs is None or rule is None:
        return _fallback(func, placement, srcs, outs, inplace, rows, geometry)
    # the context keeps meta stand-ins, not the call's tensors: a cached decision must not pin them
    ctx = Ctx(func, tuple(tuple(t.shape) for t in tensors),
              tuple(None if o is None else tuple(o.shape) for o in outs), meta_args, meta_kwargs, placement.shape,
              geometry)
    if rule.decompose is not None and rule.decompose_when(ctx, srcs):
        return Decision("decompose", rule, ctx, placement, srcs, srcs, (), None, (), inplace, False, rows, geometry)
    return Call(ctx, rule, placement, srcs, outs, inplace, rows)


def _geometry(func: Any, rule: Optional[Rule], outs: list, meta_args: tuple, meta_kwargs: dict) -> tuple:
    """Per output, the (strides, storage offset) one device gives it (`keys.geometry_of`).

    A rule's own meta (`Rule.meta`, a fast path for shapes and dtypes) makes contiguous outputs; where an
    input is not contiguous (whose layout torch's kernels carry over, a pointwise op's output of a transposed
    input is transposed) torch's own meta kernel says the strides, if it has one.
    """
    if rule is not None and rule.meta is not None and any(
            not t.is_contiguous() or t.storage_offset() for t in _meta_tensors(meta_args, meta_kwargs)):
        try:
            outs, _ = flatten_out(func(*meta_args, **meta_kwargs))
        except Exception:
            pass
    return tuple(None if o is None else geometry_of(o.shape, o.stride(), o.storage_offset()) for o in outs)


def _meta_tensors(args: tuple, kwargs: dict) -> list:
    found: list = []
    map_tensors(args, kwargs, lambda t, i: found.append(t))
    return found


def _writes_back(inplace: bool, srcs: tuple, targets: tuple, out_layouts: tuple) -> bool:
    """Whether an in-place op computes outside its target's layout and boxes the result back into it."""
    return inplace and (targets[0] != srcs[0] or out_layouts[0] != srcs[0])


def _fallback(func: Any, placement: Any, srcs: tuple, outs: Optional[list], inplace: bool,
              rows: Optional[RaggedRows] = None, geometry: Optional[tuple] = None) -> Decision:
    bcast = Layout(placement, (Broadcast(),) * placement.ndim)
    if outs is None:
        out_layouts, out_shapes, out_dtypes = None, None, None
    else:
        out_layouts = tuple(None if o is None else bcast for o in outs)
        out_shapes = tuple(None if o is None else tuple(o.shape) for o in outs)
        out_dtypes = tuple(None if o is None else o.dtype for o in outs)
    return Decision("fallback", None, None, placement, srcs, (bcast,) * len(srcs), out_layouts, out_shapes,
                    out_dtypes, inplace, inplace and srcs[0] != bcast, rows, geometry)


def axis_candidates(ctx: Ctx, rule: Rule, n_in: int, n_out: int) -> list:
    """The rule's 1-D signatures (all-Broadcast added), checked for arity."""
    sigs = list(dict.fromkeys((tuple(i), tuple(o)) for i, o in rule.signatures(ctx)))
    bcast = ((Broadcast(),) * n_in, (Broadcast(),) * n_out)
    if bcast not in sigs:
        sigs.append(bcast)
    for ins, outs in sigs:
        if len(ins) != n_in or len(outs) != n_out:
            raise AssertionError(f"{ctx.func}: rule gave signature {ins}->{outs} for {n_in} inputs/{n_out} outputs")
    return sigs


class Bill(NamedTuple):
    """What a conversion (or a kernel's own sends, or a choice's whole bill) costs: `bytes` each global rank
    receives, `collectives` launched, `ticks` each rank's receives take (its bytes times the beta of the link
    they cross) and `latency`, the alphas of its launches (ticks: `runtime/topology.py`)."""
    bytes: tuple
    collectives: int
    ticks: tuple
    latency: int

    def time(self) -> int:
        """The busiest rank's receiving plus the launches: what the bill takes (ticks)."""
        return max(self.ticks, default=0) + self.latency


NOTHING = Bill((), 0, (), 0)


def kernel_bill(sent: Optional[tuple]) -> Optional[Bill]:
    """A rule's `kernel_cost` ((bytes per rank, collectives): what its kernel sends itself) as a `Bill`,
    priced on the inside link (a kernel's ring runs on one mesh axis; which one, its cost does not say)."""
    if sent is None:
        return None
    vec, n = sent
    link = in_force().inside
    return Bill(tuple(vec), n, tuple(link.beta_ticks * b for b in vec), n * link.alpha_ticks)


@lru_cache(maxsize=8192)
def conversion_cost(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype) -> Optional[Bill]:
    """The `Bill` of boxing src -> dst (bytes per rank, collectives, and their time under the link model in
    force: a byte between nodes priced by the across link's beta, each launch by its link's alpha); None if no
    such conversion exists."""
    if src == dst:
        return NOTHING
    try:
        p = boxing.route(src, dst, shape, dtype)
    except ValueError:  # no such conversion (P(sum) cannot become P(max))
        return None
    model = in_force()
    per_rank: list = [0] * p.world
    timed: list = [0] * p.world
    for s in p.steps:
        for r, b in enumerate(s.recv_bytes):
            per_rank[r] += b
        for r, t in enumerate(boxing.step_ticks(s, model)):
            timed[r] += t
    return Bill(tuple(per_rank), sum(s.latency for s in p.steps), tuple(timed),
                sum(boxing.launch_ticks(s, model) for s in p.steps))


@lru_cache(maxsize=8192)
def owed_by(layout: Layout, shape: tuple, dtype: torch.dtype) -> Bill:
    """What a Partial output still owes: its quickest conversion to any layout without Partial.

    Every axis may change, not only the Partial ones, as the input boxing the alternatives pay may
    (the planner slices first and reduces a smaller piece): so reducing now and reducing later are
    weighed alike, and slicing an input only to make a smaller Partial is no saving.
    """
    if not layout.has_partial:
        return NOTHING
    choices = [Broadcast()] + [Split(d) for d in range(len(shape))]
    best = None
    for sbp in itertools.product(*[choices] * layout.placement.ndim):
        dst = Layout(layout.placement, sbp)
        try:
            dst.check_shape(shape)
        except ValueError:
            continue
        cost = conversion_cost(layout, dst, shape, dtype)
        if cost is not None and (best is None or _owing_rank(cost) < _owing_rank(best)):
            best = cost
    return best if best is not None else NOTHING


def backward_key() -> tuple:
    """What of autograd's state a decision depends on: in the backward, what a Partial output owes is paid
    its bytes but not its launches. A gradient's reduction is launched later with the rest of the step's
    (the gradient bucket reduces a step's gradients together, DDP's buckets), where a collective made now is
    launched now: so a weight's gradient stays Partial for the bucket rather than an all-to-all inside the
    backward that moves fewer bytes but adds a launch per layer (DTensor's choice too). Empty while the
    link model has no alpha (nothing to weigh, and the cached decisions serve forward and backward alike)."""
    model = in_force()
    if not (model.inside.alpha or model.across.alpha):
        return ()
    return (torch._C._current_autograd_node() is not None,)


def _owing_rank(bill: Bill) -> tuple:
    """Quickest first (with no alpha: the busiest rank's priced bytes), then fewer collectives."""
    return bill.time(), bill.collectives


def owed(layout: Layout, shape: tuple, dtype: torch.dtype, boxed: frozenset = frozenset()) -> Optional[Bill]:
    """What an output in `layout` still owes. One that is a parameter's gradient (`scope.grad_sink`: in the
    backward node that hands it to the parameter's accumulation) its conversion into the parameter's layout,
    which the optimizer reads, less the reduction of a Partial the op made (the mesh axes not in `boxed`, on
    which no input was boxed into Partial): the gradient bucket reduces every pending Partial gradient
    together, DDP's all-reduce, which every data-parallel step pays once for a parameter whatever op made its
    gradient, and once for the sum of a tied parameter's uses; a split the parameter does not have is gathered
    back there. A Partial an input was boxed into (a split gradient zero-padded) is charged its reduction: the
    bucket would all-reduce what it could have gathered. Any other Partial output owes its quickest reduction
    (`owed_by`), unless a scope excuses it (a named module's, a ZeRO module's reduce-scatter)."""
    sink = grad_sink(shape, dtype)
    if sink is not None and sink.placement == layout.placement:
        bucket = Layout(sink.placement, tuple(s if isinstance(s, Partial) and a not in boxed else d
                                              for a, (s, d) in enumerate(zip(layout.sbp, sink.sbp))))
        bill = conversion_cost(layout, bucket, shape, dtype)
        if bill is None:
            bill = conversion_cost(layout, sink, shape, dtype)
    elif not layout.has_partial or excused(shape):
        return NOTHING
    else:
        bill = owed_by(layout, shape, dtype)
    # in the backward: launched with the bucket's (one launch a bucket)
    return bill._replace(latency=0) if bill is not None and backward_key() else bill


def boxed_into_partial(srcs: tuple, targets: tuple) -> frozenset:
    """The mesh axes on which some input is boxed into Partial (from a split or a Broadcast: no bytes)."""
    return frozenset(a for s, t in zip(srcs, targets) if s is not None and t is not None
                     for a, (x, y) in enumerate(zip(s.sbp, t.sbp))
                     if isinstance(y, Partial) and not isinstance(x, Partial))


def signature_cost(ctx: Ctx, srcs: tuple, tensors: list, targets: tuple, out_layouts: tuple, outs: list,
                   inplace: bool) -> tuple:
    """(time, the busiest rank's receive time, all ranks' receive time, collectives, collectives now) of one
    choice (ticks, `runtime/topology.py`): boxing its inputs, what its kernel sends itself (`Rule.kernel_cost`),
    what its outputs owe, and what it computes (`ops/flops.py`). Time is the slowest rank's receiving and
    computing plus every launch's alpha; on one node the receive times are its bytes times one beta, so
    the ties after time break on bytes as they did before times.

    An in-place op owes the conversion of its result into its target's layout; any other op owes, for
    each Partial output, the quickest reduction (except inside a module whose boundary layouts the user
    named: see `ops/scope.py`), and for a parameter's gradient its conversion into the parameter's layout
    (`owed`). Infinite when some conversion does not exist. On equal
    times, bytes and collectives, the choice that communicates later wins: a Partial passed on may meet a
    consumer that takes it as it is (a linear op, the gradient bucket) and never pay.
    """
    seen: set = set()  # one tensor in two slots boxed to one layout is boxed once (addcmul_(g, g))
    bills = []
    for s, t, x in zip(srcs, targets, tensors):
        if (id(x), t) not in seen:
            seen.add((id(x), t))
            bills.append(conversion_cost(s, t, tuple(x.shape), x.dtype))
    rule = RULES.get(ctx.func)
    if rule is not None and rule.kernel_cost is not None:
        bills.append(kernel_bill(rule.kernel_cost(ctx, srcs, targets, out_layouts)))
    if any(b is None for b in bills):
        return (float("inf"), 0, 0, 0, 0)
    now = sum(b.collectives for b in bills)
    if inplace:
        bills.append(conversion_cost(out_layouts[0], srcs[0], ctx.out_shapes[0], outs[0].dtype))
    else:
        boxed = boxed_into_partial(srcs, targets)
        bills += [owed(lay, tuple(ctx.out_shapes[j]), outs[j].dtype, boxed) for j, lay in enumerate(out_layouts)
                  if lay is not None]
    if any(b is None for b in bills):
        return (float("inf"), 0, 0, 0, 0)
    bill = summed(bills)
    busy = list(bill.ticks)
    work = compute_ticks(ctx, targets, out_layouts)
    if work is not None:
        busy += [0] * (len(work) - len(busy))
        for r, t in enumerate(work):
            busy[r] += t
    return (max(busy, default=0) + bill.latency, max(bill.ticks, default=0), sum(bill.ticks), bill.collectives, now)


def compute_ticks(ctx: Ctx, targets: tuple, out_layouts: tuple) -> Optional[tuple]:
    """Per global rank, the time its shards' FLOPs take at the link model's compute rate (`ops/flops.py`);
    None where the op's FLOPs are not known or compute is not weighed."""
    rate = in_force().flop_ticks
    count = flops.formula(ctx.func)
    if not rate or count is None or not targets:
        return None
    placement = targets[0].placement
    ins = [t.local_shapes(s) for t, s in zip(targets, ctx.shapes)]
    want = [None if w is None else w.local_shapes(s) for w, s in zip(out_layouts, ctx.out_shapes)]
    world = max(placement.flat_ranks) + 1
    work = flops.per_rank(ctx.func, count, ctx.args, ctx.kwargs, ins, want, placement.flat_ranks, world,
                          meta_like, map_tensors)
    return tuple(rate * f for f in work)


def summed(bills: list) -> Bill:
    """Several bills as one: bytes and times rank by rank, collectives and launches added."""
    per_rank: list = []
    timed: list = []
    for b in bills:
        if len(per_rank) < len(b.bytes):
            per_rank += [0] * (len(b.bytes) - len(per_rank))
            timed += [0] * (len(b.bytes) - len(timed))
        for r, (n, t) in enumerate(zip(b.bytes, b.ticks)):
            per_rank[r] += n
            timed[r] += t
    return Bill(tuple(per_rank), sum(b.collectives for b in bills), tuple(timed), sum(b.latency for b in bills))


def _choose(call: Call, tensors: list) -> Optional[tuple]:
    """(targets, out layouts) of the cheapest valid nd signature (one 1-D signature per mesh axis).

    A signature is only taken if the local kernel, run on meta shards of every
    rank, yields exactly the shards its output layouts describe.
    """
    ctx, rule, placement, srcs, outs, inplace, _ = call
    laid = _laid(call, tensors)

    def owes_nothing(targets: tuple, out_layouts: tuple) -> bool:
        if targets != srcs:
            return False
        if rule.kernel_cost is not None and rule.kernel_cost(ctx, srcs, targets, out_layouts) != ((), 0):
            return False
        if inplace:
            return out_layouts[0] == srcs[0]
        return all(lay is None or owed(lay, tuple(ctx.out_shapes[j]), outs[j].dtype) == NOTHING
                   for j, lay in enumerate(out_layouts))

    # a choice that boxes nothing and owes nothing costs nothing: the first valid one wins without
    # planning any conversion (boxing searches are most of a cache miss)
    for targets, out_layouts in laid:
        if owes_nothing(targets, out_layouts) and valid(ctx, rule, targets, out_layouts, placement):
            return targets, out_layouts

    def rank(k: int) -> tuple:
        """Time first (`signature_cost`), then the busiest rank's and all ranks' receive times and
        collectives (on one node: bytes, as before times); on ties an in-place op keeps computing in its
        target (a reduced Partial operand is remembered for the next op that reads it, a written-back result
        is not), then fewer collectives now, then more inputs kept as they are, then the rule's order."""
        targets, out_layouts = laid[k]
        time, most, total, latency, now = signature_cost(ctx, srcs, tensors, targets, out_layouts, outs, inplace)
        return (time, most, total, latency, _writes_back(inplace, srcs, targets, out_layouts), now,
                sum(s != t for s, t in zip(srcs, targets)), k)

    for time, *_, k in sorted(rank(k) for k in range(len(laid))):
        if time == float("inf"):
            break
        if valid(ctx, rule, *laid[k], placement):
            return laid[k]
    return None


def _laid(call: Call, tensors: list) -> list:
    """The nd signatures as (input layouts, output layouts), in the rule's order (with ragged rows, those
    that move no data: `RaggedRows`)."""
    ctx, rule, placement, srcs, outs, _, rows = call
    n_in, n_out = len(tensors), len(outs)
    cands = axis_candidates(ctx, rule, n_in, n_out)
    per_axis = [cands if rows is None else [c for c in cands if rows.admits(*c, a, srcs, ctx)]
                for a in range(placement.ndim)]
    combos = itertools.islice(itertools.product(*per_axis), MAX_COMBOS)
    laid = [(tuple(Layout(placement, tuple(sig[0][i] for sig in combo)) for i in range(n_in)),
             tuple(None if outs[j] is None else Layout(placement, tuple(sig[1][j] for sig in combo))
                   for j in range(n_out)))
            for combo in combos]
    if rows is None:
        return laid
    return [(t, o) for t, o in laid if rows.carried_alike(o) and
            (rule.kernel_cost is None or rule.kernel_cost(ctx, srcs, t, o) == ((), 0))]


def valid(ctx: Ctx, rule: Rule, targets: tuple, out_layouts: tuple, placement: Any) -> bool:
    """Whether the local kernel, run on meta shards, yields on every rank the shards `out_layouts` describe.

    Ranks whose input and expected output shard shapes are alike are checked once.
    """
    for lay, shape in zip(out_layouts, ctx.out_shapes):
        if lay is not None:
            try:
                lay.check_shape(shape)
            except ValueError:
                return False
    ins = [t.local_shapes(s) for t, s in zip(targets, ctx.shapes)]
    want = [w.local_shapes(s) for w, s in zip(out_layouts, ctx.out_shapes) if w is not None]
    first: dict = {}  # distinct (input shapes..., expected output shapes...) -> a rank index showing it
    for k, combo in enumerate(zip(*ins, *want)):
        first.setdefault(combo, k)
    n_in = len(ins)
    for combo, k in first.items():
        shapes, expect = combo[:n_in], iter(combo[n_in:])
        try:
            largs, lkwargs = map_tensors(ctx.args, ctx.kwargs, lambda t, i: meta_like(t, shapes[i]))
            where = ShardSite(ctx, targets, out_layouts, placement.flat_ranks[k], checking=True)
            if rule.kernel is None:
                got = rule.meta(ctx.func, largs, lkwargs) if rule.meta is not None else ctx.func(*largs, **lkwargs)
            else:
                got = rule.kernel(ctx.func, largs, lkwargs, where)
            got, _ = flatten_out(got)
        except Exception:
            return False
        for g, lay in zip(got, out_layouts):
            if lay is not None and (g is None or tuple(g.shape) != next(expect)):
                return False
    return True



on_change(conversion_cost.cache_clear)
on_change(owed_by.cache_clear)
