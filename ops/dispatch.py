"""The one dispatcher: rule -> cheapest nd signature -> box inputs -> local kernel -> wrap outputs.

It works on (local tensor, layout, global shape) triples; `globaltensor.tensor`
unwraps and wraps GlobalTensors around it (the class comes in as `cls`, so
this module never imports the front door). The decision for an
(op, input layouts, shapes, dtypes, static args) key is made once and cached;
a cache hit is one dictionary look-up, the boxing of inputs that need it and
the kernel.
"""
from __future__ import annotations

import itertools
import os
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import boxing
from ..layout import Layout, slice_box
from ..runtime import context
from ..sbp import Broadcast, Partial, Split
from .registry import RULES, Ctx, Local, Rule, is_inplace

aten = torch.ops.aten
_MAX_COMBOS = 4096  # nd signatures scored per decision (only on a cache miss)

_IMPOSSIBLE = (1 << 62,)
_CACHE: dict[tuple, "Decision"] = {}
_FAST: dict[tuple, Callable] = {}  # flat key -> the decision's fast path (see _fast_path)
_STATS: dict[str, Counter] = {"fallback": Counter(), "boxed": Counter(), "decisions": Counter()}
_WARNED: set = set()
_FRESH = WeakIdKeyDictionary()  # locals of outputs that hold no values yet (rule.fresh)
_REDUCED = WeakIdKeyDictionary()  # Partial GlobalTensor -> {target layout: (versions, reduced local)}
_PENDING = weakref.WeakKeyDictionary()  # Communicator -> {Partial GlobalTensor: expected target} (defer_reduction)
_CHECK = {"replicated": os.environ.get("GT_CHECK_REPLICATED", "") not in ("", "0")}


def stats() -> dict[str, dict[str, int]]:
    """Counts per op: `fallback` (ran replicated for lack of a rule), `boxed` (calls whose inputs needed boxing)."""
    return {k: dict(v) for k, v in _STATS.items()}


def reset_stats() -> None:
    for c in _STATS.values():
        c.clear()


def check_replicated(enabled: bool = True) -> None:
    """Verify that plain tensors mixed with GlobalTensors are equal on every rank (GT_CHECK_REPLICATED=1)."""
    _CHECK["replicated"] = enabled
    clear_cache()


def clear_cache() -> None:
    _CACHE.clear()
    _FAST.clear()


# -- arguments ---------------------------------------------------------------
class TensorKey:
    """What a decision depends on of one GlobalTensor argument: (layout, shape, dtype).

    Interned, and hashed and compared by identity, so a cache-hit key is a
    tuple of such objects that hashes without looking inside layouts or shapes.
    Every GlobalTensor carries its own as `_key`.
    """
    __slots__ = ("layout", "shape", "dtype")

    def __copy__(self) -> "TensorKey":
        return self

    def __deepcopy__(self, memo: dict) -> "TensorKey":
        return self

    def __reduce__(self):
        return (tensor_key, (self.layout, self.shape, self.dtype))


_TENSOR_KEYS: dict[tuple, TensorKey] = {}


def tensor_key(layout: Layout, shape: tuple, dtype: torch.dtype) -> TensorKey:
    k = (layout, shape, dtype)
    key = _TENSOR_KEYS.get(k)
    if key is None:
        key = _TENSOR_KEYS[k] = TensorKey()
        key.layout, key.shape, key.dtype = k
    return key


def _key_of(a: Any, cls: type, tensors: list) -> Any:
    if isinstance(a, cls):
        tensors.append(a)
        return (a._layout, a.shape, a.dtype)
    if isinstance(a, torch.Tensor):
        tensors.append(a)
        return ("plain", a.shape, a.dtype)
    if isinstance(a, (list, tuple)):
        return (type(a),) + tuple(_key_of(x, cls, tensors) for x in a)
    if isinstance(a, float):
        return (float, a == 0.0)  # only zero-or-not decides a rule (masked_fill's P); lr, eps, betas do not
    return a


def _map(a: Any, fn: Callable, counter: list) -> Any:
    if isinstance(a, torch.Tensor):
        i = counter[0]
        counter[0] += 1
        return fn(a, i)
    if isinstance(a, (list, tuple)):
        return type(a)(_map(x, fn, counter) for x in a)
    return a


def map_tensors(args: tuple, kwargs: dict, fn: Callable) -> tuple[tuple, dict]:
    """Rebuild args/kwargs with every tensor (also inside lists) replaced by fn(tensor, slot index)."""
    c = [0]
    new_args = tuple(_map(a, fn, c) for a in args)
    new_kwargs = {k: _map(v, fn, c) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _flatten_out(out: Any) -> tuple[list, Callable[[list], Any]]:
    if isinstance(out, torch.Tensor):
        return [out], lambda xs: xs[0]
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        kind = type(out)
        return list(out), lambda xs: kind(xs)
    return [], lambda xs: out


def _meta(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=t.dtype, device="meta")


# -- decisions -----------------------------------------------------------------
@dataclass
class Decision:
    kind: str                         # "kernel", "decompose" or "fallback"
    rule: Optional[Rule]
    ctx: Optional[Ctx]
    placement: Any
    targets: tuple                    # per tensor slot: the layout it is boxed to
    out_layouts: tuple                # per flattened output (None for a None output)
    inplace: bool
    writeback: bool                   # in-place op computed elsewhere and boxed back to the target
    boxes: bool                       # some input needs boxing
    out_dtypes: tuple = ()            # per flattened output (kernel decisions)


def run(func: Any, args: tuple, kwargs: Optional[dict], cls: type) -> Any:
    """Entry point from GlobalTensor.__torch_dispatch__: a flat call takes its precomputed fast path."""
    if not kwargs:
        key = _flat_key(func, args, cls)
        if key is not None:
            fast = _FAST.get(key)
            if fast is None:
                tensors: list = []
                fast = _FAST[key] = _fast_path(func, _decision(func, args, {}, cls, tensors), args, cls)
            return fast(args)
    kwargs = kwargs or {}
    tensors = []
    return _run_decided(func, args, kwargs, cls, tensors, _decision(func, args, kwargs, cls, tensors))


def _decision(func: Any, args: tuple, kwargs: dict, cls: type, tensors: list) -> Decision:
    """The cached decision for this call (made on a miss); fills `tensors` with the tensor args in order."""
    key = (func, _key_of(args, cls, tensors), _key_of(tuple(kwargs.items()), cls, tensors))
    dec = _CACHE.get(key)
    if dec is None:
        dec = _CACHE[key] = _decide(func, args, kwargs, cls, tensors)
    return dec


def _run_decided(func: Any, args: tuple, kwargs: dict, cls: type, tensors: list, dec: Decision) -> Any:
    if dec.rule is not None and dec.rule.overwrites and _adopt(args, cls):
        return args[0]
    if dec.kind == "decompose":
        return dec.rule.decompose(func, args, kwargs)
    if dec.kind == "fallback":
        return _run_fallback(func, args, kwargs, cls, tensors, dec)
    return _execute(func, args, kwargs, cls, tensors, dec)


# -- the cache-hit fast path ---------------------------------------------------
_PLAIN = object()  # flat-key marker of a plain tensor (a GlobalTensor's is its TensorKey)
_ZERO, _NONZERO = object(), object()  # flat-key floats: only zero-or-not decides a rule (see _key_of)


def _flat_key(func: Any, args: tuple, cls: type) -> Optional[tuple]:
    """`_key_of` without recursion for the common call: no tensor or float inside a list; None otherwise.

    It tells calls apart at least as finely as the general key, so one
    decision serves every call with the same flat key.
    """
    key = [func]
    for a in args:
        if isinstance(a, cls):
            key.append(a._key)
        elif isinstance(a, torch.Tensor):
            key += (_PLAIN, a.shape, a.dtype)
        elif type(a) is float:
            key.append(_NONZERO if a else _ZERO)
        elif type(a) is list:
            for e in a:
                if type(e) is not int:
                    return None
            key.append((list, *a))
        elif type(a) is tuple:
            return None
        else:
            key.append(a)
    return tuple(key)


def _fast_path(func: Any, dec: Decision, args: tuple, cls: type) -> Callable[[tuple], Any]:
    """A decision's cache-hit work with everything that does not depend on the values worked out once.

    Which positions hold tensors, which of them need boxing (a decision knows
    its source layouts), the output wrappers, and a `Local` per rank only
    where the rule has a local hook. Ranks outside the placement, other
    decision kinds and multi-output writebacks take the general path.
    """
    slots = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))

    def general(args: tuple) -> Any:
        return _run_decided(func, args, {}, cls, [args[i] for i in slots], dec)

    if dec.kind != "kernel" or dec.rule.overwrites:
        return general
    rule, ctx, placement, inplace, writeback = dec.rule, dec.ctx, dec.placement, dec.inplace, dec.writeback
    members = frozenset(placement.flat_ranks)
    kernel = getattr(func, "_op", func)  # the C++ op under OpOverload.__call__: one Python frame less
    direct = tuple(i for i, t in zip(slots, dec.targets) if isinstance(args[i], cls) and args[i]._layout == t)
    work = tuple((i, t) for i, t in zip(slots, dec.targets) if i not in direct)
    boxed_name = str(func) if dec.boxes else None
    first = slots[0] if slots else None
    wrappers = tuple(None if lay is None else cls._wrapper(lay, shape, dtype)
                     for lay, shape, dtype in zip(dec.out_layouts, ctx.out_shapes, dec.out_dtypes))
    wrap0 = wrappers[0] if len(wrappers) == 1 else None
    where: dict = {}  # rank -> Local (only built when the rule has a local hook)

    def fast(args: tuple) -> Any:
        comm = context.current()
        rank = comm.rank
        if rank not in members:
            return general(args)
        largs = list(args)
        for i in direct:
            largs[i] = args[i]._local
        if work:
            if boxed_name is not None:
                _STATS["boxed"][boxed_name] += 1
            for i, dst in work:
                largs[i] = _local_of(func, args[i], dst, cls, placement, comm)
        if writeback:
            largs[first] = largs[first].clone()
        if rule.local is None:
            result = kernel(*largs)
        else:
            loc = where.get(rank)
            if loc is None:
                loc = where[rank] = Local(ctx, dec.targets, dec.out_layouts, rank)
            result = rule.local(func, tuple(largs), {}, loc)
        if inplace:
            target = args[first]
            if writeback:
                new = box(_flatten_out(result)[0][0], dec.out_layouts[0], target._layout, target.shape)
                target._local.copy_(new)
            return target
        if wrap0 is not None and isinstance(result, torch.Tensor):
            out = wrap0(result)
        else:
            flat, rebuild = _flatten_out(result)
            out = rebuild([None if f is None or w is None else w(f) for f, w in zip(flat, wrappers)])
        if rule.fresh:
            for f in _flatten_out(result)[0]:
                _FRESH[f] = True
        return out

    return fast


def _local_of(func: Any, t: torch.Tensor, dst: Layout, cls: type, placement: Any, comm: Any) -> torch.Tensor:
    """One input's local tensor in the target layout (plain tensors are taken as Broadcast)."""
    if isinstance(t, cls):
        return box_global(t, dst)
    if _CHECK["replicated"]:
        _check_plain(func, t, placement, comm)
    src = Layout(placement, (Broadcast(),) * placement.ndim)
    return t if dst == src else box(t, src, dst, t.shape)


def _adopt(args: tuple, cls: type) -> bool:
    """`fresh.copy_(src)` where `fresh` was never written (new_empty*, empty_like) takes src's layout.

    Autograd's gradient accumulation is `steal(grad)` or `grad.new_empty_strided(..).copy_(grad)`
    depending on reference counts, which may differ between ranks; with this both give the same layout.
    """
    dst, src = args[0], args[1]
    if not (isinstance(dst, cls) and isinstance(src, cls) and dst._local in _FRESH) or \
            dst.shape != src.shape or dst._layout.placement != src._layout.placement:
        return False
    del _FRESH[dst._local]
    dst._set_layout(src._local.to(dst.dtype, copy=True), src._layout)
    return True


def _placement_of(func: Any, tensors: list, cls: type) -> Any:
    places = {t._layout.placement for t in tensors if isinstance(t, cls)}
    if len(places) > 1:
        raise ValueError(
            f"{func}: inputs live on different placements {sorted(map(repr, places))}; move them to one with "
            "x.to_global(placement, sbp) first (operators never pick a placement for you)")
    return places.pop()


def _src_layouts(tensors: list, cls: type, placement: Any) -> tuple:
    bcast = Layout(placement, (Broadcast(),) * placement.ndim)
    return tuple(t._layout if isinstance(t, cls) else bcast for t in tensors)


def _decide(func: Any, args: tuple, kwargs: dict, cls: type, tensors: list) -> Decision:
    placement = _placement_of(func, tensors, cls)
    srcs = _src_layouts(tensors, cls, placement)
    rule = RULES.get(func)
    inplace = is_inplace(func)
    bcast = Layout(placement, (Broadcast(),) * placement.ndim)
    if rule is not None and rule.decompose is not None and rule.decompose_when is None:
        return Decision("decompose", rule, None, placement, srcs, (), inplace, False, False)
    fallback = Decision("fallback", None, None, placement, (bcast,) * len(tensors), (), inplace, inplace,
                        any(s != bcast for s in srcs))
    if rule is None:
        return fallback
    try:
        meta_args, meta_kwargs = map_tensors(args, kwargs, lambda t, i: _meta(t, t.shape))
        outs, _ = _flatten_out(func(*meta_args, **meta_kwargs) if rule.meta is None else
                               rule.meta(func, meta_args, meta_kwargs))
    except Exception:
        return fallback  # no meta kernel (data-dependent output): run it replicated
    ctx = Ctx(func, tuple(tuple(t.shape) for t in tensors),
              tuple(None if o is None else tuple(o.shape) for o in outs), args, kwargs, placement.shape)
    _STATS["decisions"][str(func)] += 1
    if rule.decompose is not None and rule.decompose_when(ctx, srcs):
        return Decision("decompose", rule, ctx, placement, srcs, (), inplace, False, False)
    choice = _choose(ctx, rule, srcs, tensors, placement, inplace, outs)
    if choice is None:
        return fallback
    targets, out_layouts, writeback = choice
    return Decision("kernel", rule, ctx, placement, targets, out_layouts, inplace, writeback,
                    any(s != t for s, t in zip(srcs, targets)), tuple(None if o is None else o.dtype for o in outs))


def _axis_candidates(ctx: Ctx, rule: Rule, n_in: int, n_out: int) -> list:
    sigs = list(dict.fromkeys((tuple(i), tuple(o)) for i, o in rule.signatures(ctx)))
    bcast = ((Broadcast(),) * n_in, (Broadcast(),) * n_out)
    if bcast not in sigs:
        sigs.append(bcast)
    for ins, outs in sigs:
        if len(ins) != n_in or len(outs) != n_out:
            raise AssertionError(f"{ctx.func}: rule gave signature {ins}->{outs} for {n_in} inputs/{n_out} outputs")
    return sigs


def _choose(ctx: Ctx, rule: Rule, srcs: tuple, tensors: list, placement: Any, inplace: bool,
            outs: list) -> Optional[tuple]:
    """The nd signature (one 1-D signature per mesh axis) whose input boxing costs least.

    Cost is the most bytes any rank receives, then the number of boxing steps;
    a signature is only taken if the local kernel, run on meta shards of every
    rank, yields exactly the shards its output layouts describe.
    """
    n_in, n_out = len(tensors), len(outs)
    cands = _axis_candidates(ctx, rule, n_in, n_out)
    axes = [cands] * placement.ndim
    writeback = False
    if inplace:
        tgt = srcs[0].sbp
        keep = [[c for c in cands if c[0][0] == tgt[a] and c[1][0] == tgt[a]] for a in range(placement.ndim)]
        if all(keep):
            axes = keep
        else:
            writeback = True
    slot_cost: dict = {}

    def cost_of(i: int, sbp: tuple) -> tuple:
        k = (i, sbp)
        if k not in slot_cost:
            dst = Layout(placement, sbp)
            if dst == srcs[i]:
                slot_cost[k] = (None, 0)
            else:
                try:
                    p = boxing.plan(srcs[i], dst, tensors[i].shape, tensors[i].dtype)
                    slot_cost[k] = (p.recv_bytes, len(p.steps))
                except ValueError:  # no such conversion (P(sum) cannot become P(max))
                    slot_cost[k] = (_IMPOSSIBLE, 0)
        return slot_cost[k]

    def score(combo: tuple) -> tuple:
        per_rank: list = []
        steps = 0
        for i in range(n_in):
            vec, n = cost_of(i, tuple(sig[0][i] for sig in combo))
            if vec is _IMPOSSIBLE:
                return (float("inf"), 0)
            steps += n
            if vec is not None:
                if len(per_rank) < len(vec):
                    per_rank += [0] * (len(vec) - len(per_rank))
                for r, b in enumerate(vec):
                    per_rank[r] += b
        return (max(per_rank, default=0), steps)

    def take(combo: tuple) -> Optional[tuple]:
        """The decision's (targets, out layouts, writeback) if this combo's local kernel checks out."""
        targets = tuple(Layout(placement, tuple(sig[0][i] for sig in combo)) for i in range(n_in))
        out_layouts = tuple(None if outs[j] is None else Layout(placement, tuple(sig[1][j] for sig in combo))
                            for j in range(n_out))
        if _valid(ctx, rule, targets, out_layouts, placement):
            return targets, out_layouts, writeback or (inplace and out_layouts[0] != srcs[0])
        return None

    combos = list(itertools.islice(itertools.product(*axes), _MAX_COMBOS))  # bounded: 3-axis meshes stay cheap
    free = _first_free(combos, srcs, take)
    if free is not None:  # (0, 0) is the least cost: only combos before it could tie, and win by order
        k, chosen = free
        for c in combos[:k]:
            if score(c) == (0, 0) and (tie := take(c)) is not None:
                return tie
        return chosen
    for (cost, _), k in sorted((score(c), k) for k, c in enumerate(combos)):
        if cost == float("inf"):
            break
        chosen = take(combos[k])
        if chosen is not None:
            return chosen
    return None


def _first_free(combos: list, srcs: tuple, take: Callable) -> Optional[tuple]:
    """(index, decision) of the first valid combo that boxes no input, or None.

    A cache miss then plans no conversions (boxing searches are most of a
    miss) except for the combos listed before it.
    """
    for k, combo in enumerate(combos):
        if all(tuple(sig[0][i] for sig in combo) == src.sbp for i, src in enumerate(srcs)):
            chosen = take(combo)
            if chosen is not None:
                return k, chosen
    return None


def _valid(ctx: Ctx, rule: Rule, targets: tuple, out_layouts: tuple, placement: Any) -> bool:
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
            largs, lkwargs = map_tensors(ctx.args, ctx.kwargs, lambda t, i: _meta(t, shapes[i]))
            got, _ = _flatten_out(_meta_kernel(ctx.func, rule, largs, lkwargs,
                                               Local(ctx, targets, out_layouts, placement.flat_ranks[k])))
        except Exception:
            return False
        for g, lay in zip(got, out_layouts):
            if lay is not None and (g is None or tuple(g.shape) != next(expect)):
                return False
    return True


def _kernel(func: Any, rule: Rule, args: tuple, kwargs: dict, where: Local) -> Any:
    if rule.local is not None:
        return rule.local(func, args, kwargs, where)
    return func(*args, **kwargs)


def _meta_kernel(func: Any, rule: Rule, args: tuple, kwargs: dict, where: Local) -> Any:
    """`_kernel` on meta shards, through the rule's faster meta stand-in where it has one."""
    if rule.local is None and rule.meta is not None:
        return rule.meta(func, args, kwargs)
    return _kernel(func, rule, args, kwargs, where)


# -- execution -----------------------------------------------------------------
def box(local: torch.Tensor, src: Layout, dst: Layout, shape: Sequence[int]) -> torch.Tensor:
    """Convert one local shard to `dst` (plans are cached by boxing)."""
    if src == dst:
        return local
    return boxing.convert_local(local, src, dst, tuple(shape), context.current())


def _versions(t: Any) -> tuple:
    return (t._version, id(t._local), t._local._version)


def box_global(t: Any, dst: Layout) -> torch.Tensor:
    """Box a GlobalTensor's shard; a Partial one is reduced once per target while it is unchanged.

    So the several ops of one optimizer step that read a Partial gradient
    reduce it once. "Unchanged" is the GlobalTensor's own version counter:
    the local shard's counter is no witness, because kernels run inside
    `__torch_dispatch__` run below autograd's ADInplaceOrView key, so
    in-place ops on shards (an optimizer updating a parameter) never bump
    it; the wrapper's counter is bumped by every in-place op through the
    dispatcher and shared with its views and detached aliases. The shard's
    own counter and identity are checked too, for writes that bypass the
    dispatcher (`to_local()` views, a replaced shard). Only Partial sources
    are remembered: re-reducing is what costs, and other conversions would
    only pin memory (a ZeRO-3 all-gathered weight) for no saved bytes.
    A gradient noted by `defer_reduction` is reduced together with the other pending ones.
    """
    src = t._layout
    if src == dst:
        return t._local
    if not src.has_partial:
        return box(t._local, src, dst, t.shape)
    memo = _memo_of(t)
    now = _versions(t)
    hit = memo.get(dst)
    if hit is not None and hit[0] == now:
        return hit[1]
    pending = _PENDING.get(context.current())
    if pending and t in pending:
        if pending.pop(t) == dst:
            _flush(pending, t, dst)
            hit = memo.get(dst)
            if hit is not None and hit[0] == now:
                return hit[1]
    out = box(t._local, src, dst, t.shape)
    memo[dst] = (now, out)
    return out


def _memo_of(t: Any) -> dict:
    """The reductions remembered for GlobalTensor `t`: {target layout: (versions, reduced local)}."""
    memo = _REDUCED.get(t)
    if memo is None:
        memo = _REDUCED[t] = {}
    return memo


def defer_reduction(t: Any, dst: Layout) -> None:
    """Note a fresh Partial gradient whose reduction to `dst` should share a collective with others.

    Called by the gradient hooks of converted modules, in backward order (the same on every rank).
    The first time `box_global` is asked for a pending tensor in its expected layout, every pending
    one is reduced at once, one all-reduce per bucket (`boxing.execute_many`), and the results wait
    in the memo of reductions under the usual version check. A tensor asked for in another layout
    leaves the list and takes the normal path, so a wrong guess only costs the bucketing.
    """
    comm = context.current()
    pending = _PENDING.get(comm)
    if pending is None:
        pending = _PENDING[comm] = WeakIdKeyDictionary()
    pending[t] = dst


def _flush(pending: WeakIdKeyDictionary, t: Any, dst: Layout) -> None:
    """Reduce `t` (just taken off the list) and the pending tensors whose plan is one all-reduce; clear the list.

    Other plans are left to the normal path, which runs them only if asked.
    """
    entries = [(t, dst)] + list(pending.items())
    pending.clear()
    plans = [boxing.plan(u._layout, d, tuple(u.shape), u._local.dtype) for u, d in entries]
    keep = [i for i, p in enumerate(plans) if boxing.all_reduce_key(p) is not None]
    outs = boxing.execute_many([plans[i] for i in keep], [entries[i][0]._local for i in keep],
                               context.current())
    for i, out in zip(keep, outs):
        u, d = entries[i]
        _memo_of(u)[d] = (_versions(u), out)


def _check_plain(func: Any, t: torch.Tensor, placement: Any, comm: Any) -> None:
    got = comm.all_gather_object(t.detach().cpu(), tuple(placement.flat_ranks))
    for r, other in zip(placement.flat_ranks, got):
        if other.shape != t.shape or not torch.equal(other, t.detach().cpu()):
            raise ValueError(
                f"{func}: a plain tensor argument (shape {tuple(t.shape)}) differs between rank "
                f"{placement.flat_ranks[0]} and rank {r}; plain tensors mixed with GlobalTensors are taken as "
                "Broadcast and must be equal on every rank (make it with gt.to_global/gt.from_local instead)")


def _locals(func: Any, tensors: list, dec: Decision, cls: type, comm: Any) -> list:
    return [_local_of(func, t, dst, cls, dec.placement, comm) for t, dst in zip(tensors, dec.targets)]


def _execute(func: Any, args: tuple, kwargs: dict, cls: type, tensors: list, dec: Decision) -> Any:
    comm = context.current()
    ctx = dec.ctx
    if dec.boxes:
        _STATS["boxed"][str(func)] += 1
    inside = comm.rank in dec.placement
    if inside:
        locs = _locals(func, tensors, dec, cls, comm)
        if dec.writeback:
            locs[0] = locs[0].clone()
        largs, lkwargs = map_tensors(args, kwargs, lambda t, i: locs[i])
        result = _kernel(func, dec.rule, largs, lkwargs, Local(ctx, dec.targets, dec.out_layouts, comm.rank))
        flat, rebuild = _flatten_out(result)
    else:
        device = comm.device_for(dec.placement.device_type)  # the sim's ranks hold cuda shards with a cpu comm
        flat = [None if s is None else torch.empty((0,), dtype=d, device=device)
                for s, d in zip(ctx.out_shapes, dec.out_dtypes)]
        rebuild = _flatten_out(tuple(flat) if len(flat) != 1 else flat[0])[1]
    if dec.inplace:
        target = tensors[0]
        if dec.writeback and inside:
            new = box(flat[0], dec.out_layouts[0], target._layout, target.shape)
            target._local.copy_(new)
        return target
    wrapped = [None if f is None or lay is None else cls(f, lay, shape)
               for f, lay, shape in zip(flat, dec.out_layouts, ctx.out_shapes)]
    if dec.rule.fresh:
        for f in flat:
            _FRESH[f] = True
    return rebuild(wrapped)


def _run_fallback(func: Any, args: tuple, kwargs: dict, cls: type, tensors: list, dec: Decision) -> Any:
    """No rule (or no meta kernel): Broadcast every input, run replicated, outputs Broadcast."""
    name = str(func)
    _STATS["fallback"][name] += 1
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"globaltensor: no SBP rule for {name}; its inputs are gathered to Broadcast and it runs "
                      "replicated (counted in gt.stats()['fallback'])", stacklevel=3)
    comm = context.current()
    bcast = dec.targets[0] if dec.targets else None
    if comm.rank not in dec.placement:
        return None if dec.inplace else _fallback_outside(func, args, kwargs, cls, tensors, bcast)
    locs = _locals(func, tensors, dec, cls, comm)
    if dec.inplace:
        locs[0] = locs[0].clone()
    largs, lkwargs = map_tensors(args, kwargs, lambda t, i: locs[i])
    result = func(*largs, **lkwargs)
    if dec.inplace:
        target = tensors[0]
        target._local.copy_(box(locs[0], bcast, target._layout, target.shape))
        return target
    flat, rebuild = _flatten_out(result)
    return rebuild([None if f is None else cls(f, bcast, tuple(f.shape)) for f in flat])


def _fallback_outside(func, args, kwargs, cls, tensors, bcast):
    largs, lkwargs = map_tensors(args, kwargs, lambda t, i: _meta(t, t.shape))
    flat, rebuild = _flatten_out(func(*largs, **lkwargs))
    device = context.current().device_for(bcast.placement.device_type)
    return rebuild([None if f is None else cls(torch.empty((0,), dtype=f.dtype, device=device), bcast, tuple(f.shape))
                    for f in flat])


def candidates_cost(func: Any, args: tuple, kwargs: dict, cls: type) -> list[tuple[tuple, tuple]]:
    """For tests: every valid nd signature's (cost, input layouts), cheapest first, and the chosen one."""
    tensors: list = []
    _key_of(args, cls, tensors), _key_of(tuple((kwargs or {}).items()), cls, tensors)
    placement = _placement_of(func, tensors, cls)
    srcs = _src_layouts(tensors, cls, placement)
    rule = RULES[func]
    meta_args, meta_kwargs = map_tensors(args, kwargs or {}, lambda t, i: _meta(t, t.shape))
    outs, _ = _flatten_out(func(*meta_args, **meta_kwargs))
    ctx = Ctx(func, tuple(tuple(t.shape) for t in tensors),
              tuple(None if o is None else tuple(o.shape) for o in outs), args, kwargs or {}, placement.shape)
    cands = _axis_candidates(ctx, rule, len(tensors), len(outs))
    result = []
    for combo in itertools.product(*[cands] * placement.ndim):
        targets = tuple(Layout(placement, tuple(sig[0][i] for sig in combo)) for i in range(len(tensors)))
        out_layouts = tuple(None if outs[j] is None else Layout(placement, tuple(sig[1][j] for sig in combo))
                            for j in range(len(outs)))
        if not _valid(ctx, rule, targets, out_layouts, placement):
            continue
        per_rank = [0]
        try:
            for s, t, x in zip(srcs, targets, tensors):
                if s != t:
                    vec = boxing.plan(s, t, x.shape, x.dtype).recv_bytes
                    per_rank = [a + b for a, b in itertools.zip_longest(per_rank, vec, fillvalue=0)]
        except ValueError:  # no such conversion (P(sum) cannot become P(max)): not a candidate
            continue
        result.append((max(per_rank), targets))
    return sorted(result, key=lambda r: r[0])


def decision_for(func: Any, args: tuple, kwargs: Optional[dict], cls: type) -> Optional[Decision]:
    tensors: list = []
    key = (func, _key_of(args, cls, tensors), _key_of(tuple((kwargs or {}).items()), cls, tensors))
    return _CACHE.get(key)
