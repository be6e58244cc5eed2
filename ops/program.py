"""A decision compiled into the one program that runs every call with its key.

Everything that does not depend on the values is worked out once: where the
tensor arguments sit, which need boxing (a decision knows their source
layouts), the output wrappers, the kernel. The same program serves the first
call and every cache hit, flat and nested arguments, kernels, decompositions
and replicated fallbacks, ranks inside the placement and ranks outside it
(which hold empty shards of the right dtype and compute nothing: pipeline
stages are exactly that).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils.weak import WeakIdKeyDictionary

from torch._C import _increment_version

from ..layout import Layout
from ..runtime import context
from ..sbp import Broadcast
from .decide import Decision, flatten_out, map_tensors
from .errors import kernel_error
from .keys import geometry_of
from .inputs import box, local_of
from .registry import ShardSite
from .stats import STATS, note_fallback

_FRESH = WeakIdKeyDictionary()  # shards of outputs that hold no values yet (rule.fresh)
# a fresh target that took its source whole (`_adopt`) -> that source: a step plan records the target as the
# source's value, whose layout it follows, not as a layout of its own
ADOPTED = WeakIdKeyDictionary()

Program = Callable[[tuple, dict], Any]


def compile_program(func: Any, dec: Decision, args: tuple, kwargs: dict, cls: type) -> Program:
    """The program for every call whose key matches this one's (same structure, layouts, shapes, dtypes)."""
    every = _tensor_list(args, kwargs)
    top = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    slots = top if len(top) == len(every) else None  # all tensors are positional: rebuilt by position

    def tensors_of(args: tuple, kwargs: dict) -> list:
        return [args[i] for i in slots] if slots is not None else _tensor_list(args, kwargs)

    rule = dec.rule
    if dec.rows is not None:  # decided on balanced stand-ins: the ragged wing runs it on the true shards
        def on_stand_ins(args: tuple, kwargs: dict) -> Any:
            raise AssertionError(f"{func}: a call with ragged inputs is decided here and run by the ragged "
                                 "tensor's op path, never by a program")
        on_stand_ins.decision = dec  # type: ignore[attr-defined]
        return on_stand_ins
    if dec.kind == "decompose":
        if not rule.overwrites and dec.out_geometry is not None and not dec.inplace:
            run_decomposition = compile_decomposition(func, rule, cls)

            def decomposed(args: tuple, kwargs: dict) -> Any:
                return restride(run_decomposition(args, kwargs), dec.out_geometry, tensors_of(args, kwargs))
        elif not rule.overwrites:
            decomposed = compile_decomposition(func, rule, cls)
        else:
            def decomposed(args: tuple, kwargs: dict) -> Any:
                tensors = tensors_of(args, kwargs)
                refuse_cut(func, tensors[0])
                if _adopt(tensors, cls):
                    return args[0]
                return rule.decompose(func, args, kwargs)
        decomposed.decision = dec  # type: ignore[attr-defined]
        return decomposed

    fallback = dec.kind == "fallback"
    name = str(func)
    placement, targets, out_layouts, inplace, writeback = (dec.placement, dec.targets, dec.out_layouts,
                                                          dec.inplace, dec.writeback)
    members = frozenset(placement.flat_ranks)
    kernel = getattr(func, "_op", func)  # the C++ op under OpOverload.__call__: one Python frame less
    own_kernel = None if rule is None else rule.kernel  # a rule's kernel, told where its shards sit
    overwrites = rule is not None and rule.overwrites
    fresh = rule is not None and rule.fresh
    keep_converted = rule is not None and rule.keep_converted_inputs and not inplace
    direct = tuple(k for k, (x, s, t) in enumerate(zip(every, dec.sources, targets))
                   if isinstance(x, cls) and s == t)
    work = tuple((k, targets[k]) for k in range(len(targets)) if k not in direct)
    boxed = dec.boxes
    known = dec.out_shapes is not None
    geometry = dec.out_geometry or (None,) * len(out_layouts) if known else ()
    wrappers = tuple(None if lay is None else cls._wrapper(lay, shape, dtype, at)
                     for lay, shape, dtype, at in zip(out_layouts, dec.out_shapes, dec.out_dtypes, geometry)) \
        if known else ()
    wrap_one = wrappers[0] if len(wrappers) == 1 else None
    restates = inplace and known and changes_metadata(func, every[0], dec.out_shapes[0], dec.out_dtypes[0])
    where: dict = {}  # rank -> ShardSite, built only where the rule has its own kernel

    # positions of the tensor slots (flat calls): the common call is rebuilt without a tensor list
    direct_at = tuple(slots[k] for k in direct) if slots is not None else ()
    work_at = tuple((slots[k], dst) for k, dst in work) if slots is not None else ()
    # a fallback's tensors that the op writes besides its target (rrelu_with_noise's noise), boxed for the run:
    # the kernel wrote the boxed copy, so the values are boxed back
    written = _written_slots(func, args, kwargs, every, slots, work, inplace, cls) if fallback else ()
    writes = inplace or bool(written)
    # what the kernel writes in place: a copy where the result is boxed back; where the op changes the target's
    # metadata in place, a new view of its shard (another GlobalTensor holding the same shard object keeps its
    # sizes: the target takes the view)
    first_copy = torch.Tensor.clone if writeback else torch.ops.aten.alias.default if restates else None
    needs_tensors = overwrites or writes or slots is None
    # a view op whose input had to change layout (a slice of a split dim) computes on a converted copy: its
    # outputs hold no view of the input's shards, so they are marked, and so are views of them (`refuse_cut`)
    view = func.is_view and not inplace
    unaliased = rule is not None and (rule.unaliased(dec.ctx, targets, out_layouts) if callable(rule.unaliased)
                                      else rule.unaliased)
    cuts = view and (any(k == 0 for k, _ in work) or unaliased)

    def program(args: tuple, kwargs: dict) -> Any:
        tensors = tensors_of(args, kwargs) if needs_tensors else None
        if overwrites and _adopt(tensors, cls):
            return tensors[0]
        if fallback:
            note_fallback(name)
        comm = context.current()
        rank = comm.rank
        if rank not in members:
            return _outside(func, dec, args, kwargs, tensors_of(args, kwargs), cls, comm, wrappers, restates)
        if boxed:
            STATS["boxed"][name] += 1
        if slots is not None:
            largs = list(args)
            for i in direct_at:
                largs[i] = args[i]._local
            for i, dst in work_at:
                largs[i] = local_of(func, args[i], dst, cls, placement, comm)
                if keep_converted:
                    _keep(args[i], largs[i], dst, cls)
            if first_copy is not None:
                largs[slots[0]] = first_copy(largs[slots[0]])
        else:
            locs = [None] * len(tensors)
            for k in direct:
                locs[k] = tensors[k]._local
            for k, dst in work:
                locs[k] = local_of(func, tensors[k], dst, cls, placement, comm)
                if keep_converted:
                    _keep(tensors[k], locs[k], dst, cls)
            if first_copy is not None:
                locs[0] = first_copy(locs[0])
            largs, kwargs = map_tensors(args, kwargs, lambda t, i: locs[i])
        try:  # free until something raises (Python 3.11's exceptions cost nothing on the way through)
            if own_kernel is None:
                result = kernel(*largs, **kwargs)
            else:
                loc = where.get(rank)
                if loc is None:
                    loc = where[rank] = ShardSite(dec.ctx, targets, out_layouts, rank)
                result = own_kernel(func, tuple(largs), kwargs, loc)
        except Exception as e:  # a value the meta kernel could not see (an index out of range): say where
            err = kernel_error(func, e, tensors_of(args, kwargs), cls, rank)
            if err is e:
                raise
            raise err from e
        if writes:  # one test on the common path, as before: an in-place target, or other written tensors
            if inplace:
                refuse_cut(func, tensors[0])
            for k in written:
                t = tensors[k]
                t._local.copy_(box(largs[slots[k]] if slots is not None else locs[k], targets[k], t._layout, t.shape))
            if inplace:
                target = tensors[0]
                if restates:  # the op changed the target's shape or strides: it takes the result, not its values
                    restate(target, func, args, kwargs, flatten_out(result)[0][0], out_layouts[0])
                elif writeback:
                    target._local.copy_(box(flatten_out(result)[0][0], out_layouts[0], target._layout, target.shape))
                return target
        if wrap_one is not None and isinstance(result, torch.Tensor):
            out = wrap_one(result)
        else:
            outs, rebuild = flatten_out(result)
            if known:
                out = rebuild([None if o is None or w is None else w(o) for o, w in zip(outs, wrappers)])
            else:
                out = _wrap_discovered(outs, rebuild, dec, cls, comm, members)
        if fresh:
            for o in flatten_out(result)[0]:
                _FRESH[o] = True
        if view and (cuts or getattr(args[0], "_cut_from", None) is not None):
            for o in flatten_out(out)[0]:
                if o is not None:
                    o._cut_from = getattr(args[0], "_cut_from", None) or str(func)
        return out

    program.decision = dec  # type: ignore[attr-defined]
    return program


def refuse_cut(func: Any, target: Any) -> None:
    """An in-place write into a view whose input had to change layout for it would land in a converted copy,
    never in the tensor it was cut from (one device writes through the view): an error, not a lost write."""
    cut = getattr(target, "_cut_from", None)
    if cut is not None:
        raise RuntimeError(
            f"{func}: writes into a view ({cut}) of a tensor whose split the view crosses: such a view is "
            "computed on a gathered copy, not on the tensor's shards, so the write would not reach the tensor. "
            "Write into the tensor with one op instead (x.index_put_, x.masked_fill_, x.copy_(torch.where(...)), "
            "x.slice_scatter), lay the tensor out so the view keeps a split it does not cross, or clone() the "
            "view to use it on its own")


def compile_decomposition(func: Any, rule: Any, cls: type) -> Callable[[tuple, dict], Any]:
    """A decomposition's program: its own calls are dispatched, so nothing in it depends on the call's key
    (the dispatcher keeps one per op for rules that always decompose, `dispatch._keying`)."""
    written = _written(func)

    def decomposed(args: tuple, kwargs: dict) -> Any:
        out = rule.decompose(func, args, kwargs)
        if written:
            _bump_written(written, args, kwargs, cls)
        return out
    return decomposed


def _written(func: Any) -> tuple:
    """The (position, name) of the tensor lists an in-place foreach op writes (`_foreach_mul_`'s first)."""
    if not func._schema.name.startswith("aten::_foreach_"):
        return ()
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _bump_written(written: tuple, args: tuple, kwargs: dict, cls: type) -> None:
    """Bump the version of each GlobalTensor an in-place foreach op wrote.

    The reductions remembered for a Partial gradient (`ops/inputs.py`) are valid while its version is
    unchanged. Autograd bumps it for an in-place op called on a GlobalTensor, but not for each tensor
    of a foreach op's list (`clip_grad_norm_(foreach=True)`'s `_foreach_mul_`), and the per-tensor ops
    the decomposition runs inside the dispatcher bump nothing: without this, the optimizer would read
    the gradient as reduced before it was scaled. Only foreach ops: an op that mutates an input as a
    side effect (batch norm's running statistics) is not a change autograd counts on one device either,
    and counting it would fail the backward that saved them."""
    for i, name in written:
        a = args[i] if i < len(args) else kwargs.get(name)
        ts = a if isinstance(a, (list, tuple)) else (a,)
        _increment_version(tuple(t for t in ts if isinstance(t, cls)))


def _written_slots(func: Any, args: tuple, kwargs: dict, every: list, slots: Any, work: tuple, inplace: bool,
                   cls: type) -> tuple:
    """The tensor slots, boxed for the run, that the op's schema marks as written (`Tensor(b!)`), besides an
    in-place target (which the in-place path writes back). Where every tensor is positional a slot is matched
    by its position, so a tensor also passed to an argument the op only reads is not written back from there."""
    boxed = {k for k, _ in work}
    found = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write or a.is_out or (inplace and i == 0):
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        if not isinstance(value, cls):
            continue
        for k, t in enumerate(every):
            if t is value and k in boxed and (slots is None or slots[k] == i):
                found.append(k)
                break
    return tuple(found)


def changes_metadata(func: Any, target: Any, out_shape: Any, out_dtype: Any) -> bool:
    """Whether an in-place op changes its target's shape, strides or dtype (squeeze_, t_, resize_, as_strided_),
    not only its values: torch tags the stride-changing ones `inplace_view` (t_ of a square matrix keeps its shape)."""
    return torch.Tag.inplace_view in func.tags or tuple(out_shape) != tuple(target.shape) or out_dtype != target.dtype


def restate(target: Any, func: Any, args: tuple, kwargs: dict, local: torch.Tensor, layout: Layout) -> None:
    """The target of an in-place op that changes its metadata takes the op's result as its shard and layout,
    and the op's sizes and strides on its wrapper.

    Copying the result's values back into the target's shard (what an in-place op that only writes values
    does) cannot hold a result of another shape, and for a stride-only change (t_ of a square matrix)
    would write the transposed values through into every tensor sharing the target's memory, where torch
    changes only the target's view of it. The wrapper's metadata is set by running the op on the wrapper
    itself with the meta kernels (no data, no dispatch: as `return_and_correct_aliasing` does for torch's
    wrapper subclasses), so it holds exactly the sizes and strides torch gives on one device.
    """
    with no_dispatch():
        was = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(was)
    target._set_layout(local, layout)


def restride(out: Any, geometry: tuple, inputs: list) -> Any:
    """A decomposition's outputs with the strides and offsets one device gives the op (its meta kernel's).

    Its own ops' outputs have theirs (a view computed as a gather is contiguous, where torch's view of a
    transposed tensor is not): the value is right either way, but the wrapper must say what one device
    says, or `stride()`, `is_contiguous()`, a later view's legality and `as_strided` would not be torch's.
    An output that is one of the inputs (a view that changed nothing) and a ragged one keep their wrappers.
    """
    outs, rebuild = flatten_out(out)
    changed = False
    for j, (o, at) in enumerate(zip(outs, geometry)):
        if o is None or not hasattr(o, "_layout") or o._layout.ragged_axes or any(o is t for t in inputs):
            continue
        shape = tuple(o.shape)
        if at != geometry_of(shape, o.stride(), o.storage_offset()):
            new = type(o)._wrapper(o._layout, shape, o.dtype, at)(o._local)
            if getattr(o, "_cut_from", None) is not None:
                new._cut_from = o._cut_from
            outs[j], changed = new, True
    return rebuild(outs) if changed else out


def _tensor_list(args: tuple, kwargs: dict) -> list:
    found: list = []
    map_tensors(args, kwargs, lambda t, i: found.append(t))
    return found


def _outside(func: Any, dec: Decision, args: tuple, kwargs: dict, tensors: list, cls: type, comm: Any,
             wrappers: tuple, restates: bool = False) -> Any:
    """A rank outside the placement: empty shards of the right dtypes, no computing, no collectives."""
    device = comm.device_for(dec.placement.device_type)  # the sim's ranks hold cuda shards with a cpu comm
    if dec.inplace:
        if restates:  # its wrapper must say what the ranks inside say (the next call's key is built from it)
            restate(tensors[0], func, args, kwargs, tensors[0]._local, dec.out_layouts[0])
        return tensors[0]
    if dec.out_shapes is None:  # data-dependent: the ranks inside tell the shapes (see _wrap_discovered)
        lay = _broadcast(dec.placement)
        metas = _shared_metas(None, comm)
        return _as_returned(func, [None if m is None else cls(torch.empty((0,), dtype=m[1], device=device),
                                                              lay, m[0], geometry=m[2]) for m in metas])
    if not dec.out_layouts:  # a Python value (is_pinned, a scalar): computed on the empty shards
        largs, lkwargs = map_tensors(args, kwargs, lambda t, i: t._local if isinstance(t, cls) else t)
        try:
            return func(*largs, **lkwargs)
        except Exception as e:
            raise ValueError(f"{func}: rank {comm.rank} is outside the placement {dec.placement} of its inputs, "
                             "where the value exists; compute it on the ranks of the placement "
                             f"(if gt.rank() in x.placement) or move x there first ({e})") from None
    empties = []
    for w, dtype in zip(wrappers, dec.out_dtypes):
        if w is None:
            empties.append(None)
            continue
        local = torch.empty((0,), dtype=dtype, device=device)
        if dec.rule is not None and dec.rule.fresh:
            _FRESH[local] = True
        empties.append(w(local))
    return _as_returned(func, empties)


def _as_returned(func: Any, outs: list) -> Any:
    """Outputs put together as the op's schema returns them (one tensor, a tuple or a list)."""
    returns = func._schema.returns
    if len(returns) == 1:
        kind = str(returns[0].type)
        if kind in ("Tensor", "Optional[Tensor]"):
            return outs[0]
        if kind.startswith("List") or kind.endswith("[]"):
            return list(outs)
    return tuple(outs)


def _broadcast(placement: Any) -> Layout:
    return Layout(placement, (Broadcast(),) * placement.ndim)


def _shared_metas(metas: Any, comm: Any) -> list:
    """(shape, dtype, geometry) per output as the first rank of the placement has them, told to every rank."""
    got = comm.all_gather_object(metas, tuple(range(comm.world_size)))
    return next(g for g in got if g is not None)


def _wrap_discovered(outs: list, rebuild: Callable, dec: Decision, cls: type, comm: Any, members: frozenset) -> Any:
    """Outputs whose shapes only the run could tell (a replicated fallback of a data-dependent op)."""
    if comm.world_size > len(members):  # ranks outside wait for the shapes
        metas = [None if o is None else (tuple(o.shape), o.dtype, _geometry(o)) for o in outs]
        _shared_metas(metas if comm.rank == dec.placement.flat_ranks[0] else None, comm)
    lay = _broadcast(dec.placement)
    # computed whole on the replicated inputs, so its strides are one device's (LAPACK's column-major solutions)
    return rebuild([None if o is None else cls(o, lay, tuple(o.shape), geometry=_geometry(o)) for o in outs])


def _geometry(o: torch.Tensor) -> Any:
    return geometry_of(o.shape, o.stride(), o.storage_offset()) if o.layout is torch.strided else None


TRACED_INPUT = "_gt_traced_input"  # __dict__ key: a GlobalTensor AOTAutograd rebuilt from a traced shard


def _keep(t: Any, local: torch.Tensor, layout: Layout, cls: type) -> None:
    """An intermediate input takes the shard it was converted to (`Rule.keep_converted_inputs`).

    Its global value is unchanged; the shard it had is released (unless something else holds it: a view's
    base keeps its own). Only autograd non-leaves: a leaf's layout (a parameter, a tensor the user laid
    out) is the user's choice, and an in-place op's target keeps its layout by the in-place rule. A view
    that takes its own shard no longer shares memory with its base: a later in-place write through one is
    not seen through the other, so a tensor autograd saved (the case this is for) raises at the backward
    if written afterwards, as torch does for any saved tensor that changes. Nor a traced program's input
    (`TRACED_INPUT`, which AOTAutograd hands with a grad_fn): a new shard there is an input mutation, which the
    compiled program would replay after its graph as a conversion back (its collectives outside the graph);
    the partitioner saves what the backward reads instead.
    """
    if isinstance(t, cls) and t.grad_fn is not None and not t.__dict__.get(TRACED_INPUT):
        t._set_layout(local, layout)


def _adopt(tensors: list, cls: type) -> bool:
    """`fresh.copy_(src)` where `fresh` was never written (new_empty*, empty_like) takes src's layout.

    Autograd's gradient accumulation is `steal(grad)` or `grad.new_empty_strided(..).copy_(grad)`
    depending on reference counts, which may differ between ranks; with this both give the same layout.
    """
    dst, src = tensors[0], tensors[1]
    if not (isinstance(dst, cls) and isinstance(src, cls) and dst._local in _FRESH) or type(src) is not type(dst) \
            or dst.shape != src.shape or dst._layout.placement != src._layout.placement:
        return False  # (a strided or zigzag source is another class: the copy boxes it)
    del _FRESH[dst._local]
    dst._set_layout(src._local.to(dst.dtype, copy=True), src._layout)
    ADOPTED[dst] = src
    return True
