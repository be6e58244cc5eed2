"""How an input's shard reaches the layout a decision wants.

Mostly one boxing route; a Partial input is reduced once per target while it
is unchanged (several ops of an optimizer step read the same gradient), and
gradients noted by `defer_reduction` are reduced (or converted) together, one
collective per bucket, as DDP does, and remembered likewise.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from functools import lru_cache
from typing import Any, Sequence

import torch

from .. import boxing
from ..boxing.transitions import LOCAL_PRIMITIVES
from ..layout import Layout
from ..runtime import context
from ..runtime.trace import FLAGS as _TRACING, pop_why, push_why
from ..sbp import Broadcast, Split

# What is remembered of a GlobalTensor lives in its own `__dict__` (the memo of its reductions, `_MEMO`; the layout
# its backward gave a gradient its bucket converted in place, `_SETTLED`), not in tables weakly keyed by it: it dies
# with the tensor, and a tensor with no weak reference can be swapped (`torch.utils.swap_tensors`, which
# `nn.Module._apply` uses for traceable subclasses: `m.double()`), which moves it to the discarded copy: what was
# remembered of the old values is gone with them.
_MEMO = "_gt_reduced"      # {target layout: (versions, reduced local)}
_SETTLED = "_gt_settled"   # (layout, local shape) its backward gave it
_PENDING = weakref.WeakKeyDictionary()  # Communicator -> _Pending (defer_reduction)


class _Pending:
    """A rank's gradients waiting for their bucketed reduction: id -> (tensor, expected target, in place).

    Held strongly (a weak reference would forbid swapping the tensor, see `_MEMO`), and let go of once the
    holder is the only one left: a gradient dropped unread (`zero_grad()` with no step between) is let go at
    the next `defer_reduction` or flush, not when it dies."""

    def __init__(self) -> None:
        self.entries: dict = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __contains__(self, t: Any) -> bool:
        e = self.entries.get(id(t))
        return e is not None and e[0] is t

    def __getitem__(self, t: Any) -> tuple:
        return self.entries[id(t)][1:]

    def __setitem__(self, t: Any, value: tuple) -> None:
        self.entries[id(t)] = (t, *value)

    def pop(self, t: Any) -> tuple:
        return self.entries.pop(id(t))[1:]

    def items(self) -> list:
        self.drop_unheld()
        return [(t, (d, place)) for t, d, place in self.entries.values()]

    def clear(self) -> None:
        self.entries.clear()

    def drop_unheld(self) -> None:
        # nobody else holds it: in Python, only the entry (and getrefcount's argument); in C++, only its own
        # Python object (a parameter's `.grad` holds the tensor there, not in Python)
        dead = [k for k, e in self.entries.items() if sys.getrefcount(e[0]) <= 2 and e[0]._use_count() <= 1]
        for k in dead:
            del self.entries[k]
_CHECK = {"replicated": os.environ.get("GT_CHECK_REPLICATED", "") not in ("", "0")}


def box(local: torch.Tensor, src: Layout, dst: Layout, shape: Sequence[int]) -> torch.Tensor:
    """Convert one local shard to `dst` (routes are cached by boxing)."""
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
    and gradients noted by `defer_reduction` are remembered for good:
    re-reducing is what costs, a gradient is read by every op of its
    optimizer's step, and other conversions would pin memory (a ZeRO-3
    all-gathered weight) for bytes rarely read twice. Except within one autograd node of the backward, whose ops often
    read one tensor in one other layout (a linear's input and weight gradients
    both read the output's gradient, which Ulysses' attention leaves split on
    the heads): there a conversion is remembered until another node runs.
    A gradient noted by `defer_reduction` is reduced together with the other pending ones.
    """
    src = t._layout
    if src == dst:
        return t._local
    pending = _PENDING.get(context.current())
    if not src.has_partial and _MEMO not in t.__dict__ and not (pending and t in pending):
        node = torch._C._current_autograd_node()
        if node is None:
            return box(t._local, src, dst, t.shape)
        return _once_in_node(t, dst, node)
    memo = _memo_of(t)
    now = _versions(t)
    hit = memo.get(dst)
    if hit is not None and hit[0] == now:
        return hit[1]
    if pending and t in pending:
        want, place = pending.pop(t)
        if want == dst:
            _flush(pending, t, dst, place)
            if t._layout == dst:  # a gradient, converted in place
                return t._local
            hit = memo.get(dst)
            if hit is not None and hit[0] == now:
                return hit[1]
    out = box(t._local, src, dst, t.shape)
    memo[dst] = (now, out)
    return out


class _NodeConversions(threading.local):
    """The conversions made while one autograd node runs (per thread: a simulated rank is one).

    The node itself is held, not its id: an id reused by a later node on one rank but not on another
    would make one rank skip a collective its peers run.
    """

    def __init__(self) -> None:
        self.node: Any = None
        self.memo: _NodeMemo = _NodeMemo()
        self.queued = False


class _NodeMemo:
    """{tensor: {layout: (versions, local)}} for one node's run, by identity; held strongly (no weak reference
    on a tensor, see `_MEMO`) for as long as the node runs, and let go when the backward ends."""

    def __init__(self) -> None:
        self.by_id: dict = {}

    def get(self, t: Any) -> Any:
        e = self.by_id.get(id(t))
        return e[1] if e is not None and e[0] is t else None

    def __setitem__(self, t: Any, memo: dict) -> None:
        self.by_id[id(t)] = (t, memo)

    def items(self) -> list:
        return list(self.by_id.values())


_IN_NODE = _NodeConversions()


def _forget_node() -> None:
    _IN_NODE.node, _IN_NODE.memo, _IN_NODE.queued = None, _NodeMemo(), False


def _once_in_node(t: Any, dst: Layout, node: Any) -> torch.Tensor:
    """`t` converted to `dst` once while the autograd node `node` runs; forgotten when another runs."""
    seen = _IN_NODE
    if seen.node is not node:
        seen.node, seen.memo = node, _NodeMemo()
        if not seen.queued:  # the last node's tensors are not kept past the backward
            seen.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_forget_node)
    memo = seen.memo.get(t)
    if memo is None:
        memo = seen.memo[t] = {}
    now = _versions(t)
    hit = memo.get(dst)
    if hit is not None and hit[0] == now:
        return hit[1]
    out = _permuted_hit(t, dst, seen.memo)
    if out is None:
        out = box(t._local, t._layout, dst, t.shape)
        _remember_for_base(t, dst, out, seen.memo)
    memo[dst] = (now, out)
    return out


def _remember_for_base(t: Any, dst: Layout, out: torch.Tensor, remembered: Any) -> None:
    """A view that permutes its base's dims (`grad.t()`, a temporary the memo would lose with it) leaves its
    conversion for the base too, permuted back, so that a later read of the base or of another such view of
    it finds it."""
    base = t._base
    if base is None or not hasattr(base, "_layout"):
        return
    perm = _permutation(t, base)
    if perm is None:
        return
    inverse = [perm.index(d) for d in range(len(perm))]
    lay = Layout(dst.placement, tuple(Split(perm[s.dim]) if isinstance(s, Split) else s for s in dst.sbp))
    memo = remembered.get(base)
    if memo is None:
        memo = remembered[base] = {}
    memo[lay] = (_versions(base), out.permute(inverse))


def _permuted_hit(t: Any, dst: Layout, remembered: Any) -> Any:
    """`t`'s shard in `dst` from a conversion remembered in this node for a tensor whose dims `t` permutes, or None.

    A linear's weight gradient reads the output's gradient transposed where its input gradient reads it as it
    is (torch's mm backward picks `grad.t().mm(x).t()` for a transposed weight, as one device does): the same
    elements, so the conversion the first made serves the second, permuted (either may come first). The
    wrappers' strides say it: two views of one base (or a base and its view) at the same offset whose sizes and
    strides are a permutation of each other."""
    root = t._base if t._base is not None else t
    for m, memo in remembered.items():
        if m is t or not memo or (m._base if m._base is not None else m) is not root:
            continue
        perm = _permutation(t, m)
        if perm is None:
            continue
        want = Layout(dst.placement, tuple(Split(perm[s.dim]) if isinstance(s, Split) else s for s in dst.sbp))
        hit = memo.get(want)
        if hit is not None and hit[0] == _versions(m):
            return hit[1].permute(perm)
    return None


def _permutation(t: Any, m: Any) -> Any:
    """The dims of `m` that `t`'s dims are (`t` is `m.permute(perm)`), read off sizes, strides and offsets."""
    if t.dim() != m.dim() or t.storage_offset() != m.storage_offset():
        return None
    free, perm = list(range(m.dim())), []
    for n, st in zip(t.shape, t.stride()):
        j = next((j for j in free if m.shape[j] == n and m.stride(j) == st), None)
        if j is None:
            return None
        free.remove(j)
        perm.append(j)
    return perm


def _memo_of(t: Any) -> dict:
    """The reductions remembered for GlobalTensor `t`: {target layout: (versions, reduced local)}."""
    d = t.__dict__
    memo = d.get(_MEMO)
    if memo is None:
        memo = d[_MEMO] = {}
    return memo


def defer_reduction(t: Any, dst: Layout, in_place: bool = False) -> None:
    """Note a fresh Partial tensor (or a gradient laid out otherwise than its parameter) whose reduction
    (conversion) to `dst` should share a collective with others.

    Called by the gradient hooks of converted modules, in backward order (the same on every rank).
    The first time `box_global` is asked for a pending tensor in its expected layout, every pending
    one is reduced at once, one all-reduce per bucket (`boxing.execute_many`), and the results wait
    in the memo of reductions under the usual version check; `in_place` (a parameter's `.grad`) instead
    makes the result the tensor's own shard and layout, as DDP leaves the reduced gradient in `.grad`:
    its global value is the same, and what changes it next (`clip_grad_norm_` rescaling every gradient
    between the bucket's read and the optimizer's) changes the reduced one, not a Partial one that each
    later read would reduce again. A tensor asked for in another layout leaves the list and takes the
    normal path, so a wrong guess only costs the bucketing. A gradient zeroed in place rather than set to
    None (`zero_grad(set_to_none=False)`) takes back its backward's layout (`unsettle`).
    """
    comm = context.current()
    pending = _PENDING.get(comm)
    if pending is None:
        pending = _PENDING[comm] = _Pending()
    elif pending:
        pending.drop_unheld()
    pending[t] = (dst, in_place)


def unsettle(t: Any) -> None:
    """A gradient the bucket converted in place, about to be zeroed in place (`zero_grad(set_to_none=False)`):
    it takes back the layout its backward gave it (a zero is as cheap in any layout), so the next backward
    accumulates into it as into a fresh gradient (Partial + Partial: nothing moved) and the bucket reduces
    it again, rather than each accumulation reducing its own Partial into the reduced layout."""
    was = t.__dict__.pop(_SETTLED, None)
    if was is not None and t._layout != was[0]:
        t._set_layout(t._local.new_zeros(was[1]), was[0])


def settle(t: Any) -> None:
    """A noted tensor about to be read whole by an op that would pick its own conversion (a norm over a list:
    a Partial gradient reduce-scattered on its own, out of the bucket): the bucket's reduction now, as its
    expected first read would make it."""
    pending = _PENDING.get(context.current())
    if pending and t in pending:
        box_global(t, pending[t][0])


def settle_step(opt: Any, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook, under `torch.compile(opt.step)` only: this rank's pending gradients reduced
    now, one collective per bucket. The step is traced on fake gradients that are not on the pending list,
    so each op would reduce its own read of a Partial gradient inside the graph (twice over for AdamW, whose
    two moments read it). Dynamo traces the hook, and `_settle_pending` is opaque to it (a graph break before
    the step's own, `torch.optim`'s `_use_grad`): it runs eagerly, and the graph is traced on the reduced
    layouts. An eager step keeps the reduction at the first read, whose op chooses the layout (a ZeRO update
    reduce-scatters into its shard)."""
    if torch.compiler.is_compiling():
        _settle_pending()


@torch._dynamo.disable
def _settle_pending() -> None:
    comm = context.current_or_none()
    pending = _PENDING.get(comm) if comm is not None else None
    if pending:
        t, (dst, _place) = next(iter(pending.items()))
        box_global(t, dst)


def _flush(pending: _Pending, t: Any, dst: Layout, place_t: bool = False) -> None:
    """Reduce `t` (just taken off the list) and the pending tensors whose route is bucketable collectives and
    local steps only (all-reduce, reduce-scatter, all-gather; a slice); clear the list.

    A route of several steps (a gradient Partial on two mesh axes, e.g. a norm weight under sequence and
    data parallelism: reduce-scatter, all-reduce, all-gather) runs step by step, each round one collective
    per bucket, so such gradients share collectives too instead of a few each. Other routes are left to the normal path, which runs them
    only if asked.
    """
    entries = [(t, dst, place_t)] + [(u, d, place) for u, (d, place) in pending.items()]
    pending.clear()
    routes = [boxing.route(u._layout, d, tuple(u.shape), u._local.dtype) for u, d, _ in entries]
    steps = {i: _one_step_routes(p) for i, p in enumerate(routes)}
    keep = [i for i, s in steps.items() if s and all(_in_bucket(q) for q in s)]
    tracing = _TRACING.on
    if tracing:  # a gt.comm_report() says these collectives are the gradient bucket
        push_why(f"gradient bucket: {len(keep)} gradients reduced (or converted) together at their first read")
    outs = [entries[i][0]._local for i in keep]
    try:
        for r in range(max((len(steps[i]) for i in keep), default=0)):
            now = [j for j, i in enumerate(keep) if r < len(steps[i])]
            done = boxing.execute_many([steps[keep[j]][r] for j in now], [outs[j] for j in now], context.current())
            for j, out in zip(now, done):
                outs[j] = out
    finally:
        if tracing:
            pop_why()
    for i, out in zip(keep, outs):
        u, d, place = entries[i]
        if place and bool(d.zigzag_axes) == bool(u._layout.zigzag_axes):
            u.__dict__[_SETTLED] = (u._layout, tuple(u._local.shape))
            u._set_layout(out, d)
        else:
            _memo_of(u)[d] = (_versions(u), out)


def _in_bucket(step: boxing.Route) -> bool:
    """A one-step route the bucket runs in its round: a bucketable collective, or a local step (a gradient Partial
    on one axis and whole on an axis its parameter splits is sliced to the parameter's shard before its
    reduction), which each rank runs on its own shard."""
    return boxing.bucket_key(step) is not None or step.steps[0].primitive in LOCAL_PRIMITIVES


@lru_cache(maxsize=4096)
def _one_step_routes(route: boxing.Route) -> tuple:
    """`route` as routes of one step each, run in order (so each step can join a bucket of its own kind)."""
    if len(route.steps) == 1:
        return (route,)
    return tuple(boxing.Route(s.src, s.dst, route.shape, route.dtype, (s,), None, route.world) for s in route.steps)


def _check_plain(func: Any, t: torch.Tensor, placement: Any, comm: Any) -> None:
    got = comm.all_gather_object(t.detach().cpu(), tuple(placement.flat_ranks))
    for r, other in zip(placement.flat_ranks, got):
        if other.shape != t.shape or not torch.equal(other, t.detach().cpu()):
            raise ValueError(
                f"{func}: a plain tensor argument (shape {tuple(t.shape)}) differs between rank "
                f"{placement.flat_ranks[0]} and rank {r}; plain tensors mixed with GlobalTensors are taken as "
                "Broadcast and must be equal on every rank (make it with gt.to_global/gt.from_local instead)")


def local_of(func: Any, t: torch.Tensor, dst: Layout, cls: type, placement: Any, comm: Any) -> torch.Tensor:
    """One input's shard in the layout a decision wants (plain tensors are taken as Broadcast)."""
    if isinstance(t, cls):
        return box_global(t, dst)
    if _CHECK["replicated"]:
        _check_plain(func, t, placement, comm)
    if not t.is_meta and comm.device_for(placement.device_type).type == "meta":
        t = t.to("meta")  # a dry run's: made on the device a wrapper reports (`arange(device=x.device)`), used on meta
    src = Layout(placement, (Broadcast(),) * placement.ndim)
    return t if dst == src else box(t, src, dst, t.shape)
