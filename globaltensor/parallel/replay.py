"""Replay: a rank runs its own part of a pipeline micro-batch, not the whole global program.

Why: every rank runs the one global program for every micro-batch. On a rank, most of it is other stages' calls
passing empty shards, and its own stages' calls are wrapped in and out of GlobalTensors, so per micro-batch a rank
makes ~1,000 Python calls more than a torch.pipelining stage, which runs its module on plain tensors between a
receive and a send (bench/RESULTS.md, session 16: 1,675 against 636 on the last stage); on cold caches between two
micro-batches' kernels that is the whole gap in step time.

What a rank's part is, once shown: per (micro-batch, chunk) a tape of
- the receives that start it (source, key, size: the program's own messages),
- its stages' calls on plain tensors (`StageForward`s of one rank, swapped onto the step's parameter leaves),
- the glue between them that computes on its shards (dispatched ops decided as a plain kernel: `x + pos`),
- the sends that end it, and where the micro-batch's loss is, if it holds it.
Recorded while the program runs (`Recorder`: the stage calls, the dispatcher's decisions and the communicator's
exchanges report to it); replayed as plain torch with autograd (`Tapes`): a chunk's backward receives the gradients
of its sends (and seeds its loss), runs autograd over the chunk, and sends its receives' gradients back.

The messages are the program's: the same peers, tags, keys and sizes, forward and backward (the backward's keys are
recorded too), so a rank replaying and a rank running the program exchange as before; each rank decides alone, and
the receives a pipeline learnt to post ahead stay valid. A tape is replayed only once two steps of equal inputs
recorded it equal (plain tensors made in the forward compared by value), and anything a tape cannot say keeps the
rank on the program, the reason in `Pipeline.replay_why`: a stage of several ranks or one with layout conversions or
module hooks, a collective, an op that converts an input or writes in place, a message of several peers, a tensor
crossing from one of the rank's chunks into another. A weight kept gathered for the step (the tied head's) is on the
tape: its gather's hooks where they ran (`Recorder.opening`, `closed`; their messages are theirs), the step's end as
in the program. What no recording can see is Python
state the forward reads besides its inputs' shapes: hence opt-in (`gt.Pipeline(replay=True)`), for programs whose
forward, given equal shapes, computes the same way (as a CUDA graph or `torch.compile` assumes).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from .local_call import call_local
from .plain import _not_local
from . import zero
from ..runtime import context
from ..runtime.trace import watching
from ..tensor import GlobalTensor, grad_layout


class NotReplayable(Exception):
    """Raised inside a recording where the rank's part cannot be a tape; its message is the reason."""


class _Recording(threading.local):
    recorder: Optional["Recorder"] = None  # the forward running on this thread is recorded (a fiber's own thread)
    paused = 0  # inside a stage call: its own calls are the call's
    gathering = 0  # inside a kept gather's hook (`Recorder.opening`): its messages are the hook's, which a replay runs


RECORDING = _Recording()


@contextlib.contextmanager
def recording(recorder: "Recorder") -> Iterator[None]:
    """The forward running on this thread recorded by `recorder`: its stage calls (`RECORDING`), the
    dispatcher's decisions (`watching`) and its gathering modules' hooks (`zero.listening`)."""
    RECORDING.recorder = recorder
    try:
        with watching(recorder.watch), zero.listening(recorder):
            yield
    finally:
        RECORDING.recorder = None


def _storage_key(t: torch.Tensor) -> tuple:
    """Two tensors with this key hold the same values in the same order."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class _Segment:
    """One (micro-batch, chunk) of this rank: its entries in program order."""
    __slots__ = ("entries", "recvs", "sends", "loss", "slots", "constants", "_kept")

    def __init__(self) -> None:
        self.entries: list = []
        self.recvs: list = []   # [slot, source, key, numel, dtype, shape, device, requires grad, backward key]
        self.sends: list = []   # [slot, destination, key, numel, dtype, device, backward key]
        self.loss: Any = None   # ("slot", slot, t) on the rank that holds it (t: its layout and key), else ("value", t)
        self.slots = 0
        self.constants: list = []  # plain tensors the forward made (compared by value between two recordings)
        self._kept: Optional[frozenset] = None

    @property
    def kept(self) -> frozenset:
        """The slots the backward reads: the sends', the receives' and the loss's."""
        if self._kept is None:
            self._kept = frozenset([s[0] for s in self.sends] + [r[0] for r in self.recvs] +
                                   ([self.loss[1]] if self.loss is not None and self.loss[0] == "slot" else []))
        return self._kept

    def signature(self) -> tuple:
        entries = tuple((e[0], e[1], *(_sig(x) for x in e[2:])) for e in self.entries)
        recvs = tuple(tuple(r[1:]) for r in self.recvs)
        sends = tuple(tuple(s) for s in self.sends)
        loss = None if self.loss is None else (self.loss[0], self.loss[1] if self.loss[0] == "slot" else None,
                                               self.loss[-1]._key)
        return entries, recvs, sends, loss, self.slots

    def same(self, other: "_Segment") -> bool:
        return self.signature() == other.signature() and len(self.constants) == len(other.constants) and all(
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            for a, b in zip(self.constants, other.constants))


def _sig(x: Any) -> Any:
    """An entry's part as compared between recordings: its own objects by identity, fillers by their shape."""
    if isinstance(x, _Filler):
        return x.signature
    if isinstance(x, tuple):
        return tuple(_sig(y) for y in x)
    return id(x) if callable(x) else x


# arguments compared by value between two recordings; any other object by identity (the same one each step)
_VALUES = (int, float, complex, bool, str, bytes, slice, type(None), type(Ellipsis), torch.dtype, torch.device,
           torch.memory_format, torch.layout, torch.Size)


class _Filler:
    """An entry's arguments with its tensors' places: the constants kept, the slots read from the tape's values."""
    __slots__ = ("values", "refs", "spec", "flat", "signature")

    def __init__(self, values: list, refs: list, spec: Any, flat: bool, signature: tuple) -> None:
        self.values, self.refs, self.spec, self.flat, self.signature = values, refs, spec, flat, signature

    def __call__(self, env: list) -> tuple:
        values = self.values.copy()
        for k, slot in self.refs:
            values[k] = env[slot]
        if self.flat:
            return tuple(values), {}
        return pytree.tree_unflatten(values, self.spec)


class Recorder:
    """One step's recording of this rank's part (the pipeline sets `current` to the action it runs)."""

    def __init__(self) -> None:
        self.segments: dict = {}   # (micro-batch, chunk) -> _Segment
        self.current: Optional[tuple] = None  # ("F" | "B", micro-batch, chunk), ("D",) after the actions
        self.why = ""
        self._by_id: dict = {}     # micro-batch -> {id(GlobalTensor): (chunk, slot)}
        self._by_data: dict = {}   # micro-batch -> {storage key: (chunk, slot)}
        self._keep: dict = {}      # micro-batch -> what its maps name, alive until its forward ends (ids not reused)

    # -- what reports here ----------------------------------------------------------------------------------
    def fail(self, why: str) -> None:
        if not self.why:
            self.why = why

    def source(self, t: GlobalTensor, which: str) -> None:
        """One of the micro-batch's inputs (`which`: its name, positional, keyword or the target) as distributed on
        this rank."""
        if t._local.numel():
            self._new(t, ("source", which, t._layout))

    def stage_call(self, stage: Any, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        """A stage module called on this rank, inside it: run and recorded as its plain call."""
        if self.why or RECORDING.paused:
            return run()
        try:
            _check_stage(stage)
            fill = self._filler(args, kwargs)
        except NotReplayable as e:
            self.fail(str(e))
            return run()
        RECORDING.paused += 1
        try:
            out = run()
        finally:
            RECORDING.paused -= 1
        self._outputs(("call", stage, fill), out)
        return out

    @contextlib.contextmanager
    def opening(self, group: Any, module: Any) -> Iterator[None]:
        """A module that gathers its parameters for the step (the tied head, `zero.ParamGroup.before`) entered on
        this rank, outside a stage call: the replay runs the same hook there (the step's one gather: its messages
        the program's, not recorded as the tape's), and its closing hook after the stage call, if any, between
        them (`zero.GatherListener`)."""
        if group.param_dtype is not None and not (self.why or RECORDING.paused):  # a replay passes no inputs
            self.fail(f"{group.where} casts its inputs to {group.param_dtype} on entry")
        self._gather_entry("open", group, module)
        RECORDING.gathering += 1
        try:
            yield
        finally:
            RECORDING.gathering -= 1

    def closed(self, group: Any, module: Any) -> None:
        self._gather_entry("close", group, module)

    def _gather_entry(self, kind: str, group: Any, module: Any) -> None:
        if self.why or RECORDING.paused:
            return  # inside a stage call: the call's own module calls run its hooks
        act = self.current
        if act is None or act[0] != "F":
            self.fail("a gathering module entered outside a forward action")
            return
        self.segments.setdefault((act[1], act[2]), _Segment()).entries.append((kind, group, module))

    def watch(self, func: Any, args: tuple, kwargs: dict, dec: Any) -> Optional[Callable[[Any], None]]:
        """The dispatcher's decision for an op of the recorded forward (`runtime.trace.watching`)."""
        if self.why or RECORDING.paused:
            return None
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, GlobalTensor)]
        if tensors and all(not t._local.numel() for t in tensors):
            return None  # other ranks' shards: nothing of this rank's
        why = _not_local(func, dec)
        if why:
            self.fail(f"{why} in the forward on this rank")
            return None
        try:
            fill = self._filler(args, kwargs)
        except NotReplayable as e:
            self.fail(str(e))
            return None
        return lambda out: self._outputs(("kernel", func, fill), out)

    def exchange(self, sends: dict, recvs: dict, key: int, got: dict, device: Any) -> None:
        """The communicator's point-to-point exchange of the action now running."""
        if self.why or RECORDING.gathering:
            return
        act = self.current
        if RECORDING.paused:
            self.fail("a stage call communicates")
            return
        if act is not None and act[0] == "D":
            return  # the step's end (a kept gather's reduction): run as it is by a replayed step too
        if act is None:
            self.fail("a message outside a pipeline step's actions")
            return
        if len(sends) + len(recvs) != 1:
            self.fail("an exchange with several peers")
            return
        kind, i, c = act
        seg = self.segments.setdefault((i, c), _Segment())
        if kind == "F":
            for src, (shape, dtype) in recvs.items():
                buf = got[src]
                slot = self._slot(seg)
                seg.recvs.append([slot, src, key, _numel(shape), dtype, tuple(shape), device, False, None])
                seg.entries.append(("recv", len(seg.recvs) - 1))
                self._remember(i, c, slot, None, buf)
            for dst, t in sends.items():
                found = self._by_data.get(i, {}).get((t.data_ptr(), t.numel(), t.dtype))
                if found is None or found[0] != c:
                    self.fail("a message whose tensor is not one this chunk computed")
                    return
                seg.sends.append([found[1], dst, key, t.numel(), t.dtype, device, None])
                seg.entries.append(("send", len(seg.sends) - 1))
            return
        # a backward: the gradients of this chunk's forward messages, each back to where it came from
        for peer in sends:
            self._backward_key(seg.recvs, peer, 8, key, "a gradient sent where no activation came from")
        for peer in recvs:
            self._backward_key(seg.sends, peer, 6, key, "a gradient received where no activation went")

    def _backward_key(self, messages: list, peer: int, at: int, key: int, why: str) -> None:
        """The backward's key for the one forward message with `peer` still without one (its index `at`)."""
        match = [m for m in messages if m[1] == peer and m[at] is None]
        if len(match) != 1:
            self.fail(why)
        else:
            match[0][at] = key

    def finish_forward(self, i: int, c: int, loss: Any) -> None:
        """Micro-batch i's forward ended in chunk c: its loss, a slot where this rank computed it."""
        seg = self.segments.setdefault((i, c), _Segment())
        found = self._by_id.get(i, {}).get(id(loss)) if isinstance(loss, GlobalTensor) else None
        if found is not None and found[0] == c:
            seg.loss = ("slot", found[1], loss.with_local(loss._local.detach()))
        elif isinstance(loss, GlobalTensor) and not loss._local.numel():  # held elsewhere: its empty value, kept
            seg.loss = ("value", loss.with_local(loss._local.detach()))
        else:
            self.fail("the loss is not a tensor this rank's last chunk computed")
        for maps in (self._by_id, self._by_data, self._keep):  # its forward is over: what it computed may go
            maps.pop(i, None)

    def done(self) -> Optional[dict]:
        """The tapes, or None (`why` says why not)."""
        self._by_id, self._by_data, self._keep = {}, {}, {}
        if self.why:
            return None
        for (i, c), seg in self.segments.items():
            if any(r[7] and r[8] is None for r in seg.recvs) or any(s[6] is None for s in seg.sends):
                self.fail("a message whose gradient never went back")
                return None
        return self.segments

    # -- slots ---------------------------------------------------------------------------------------------
    def _act(self) -> tuple:
        act = self.current
        if act is None or act[0] != "F":
            raise NotReplayable("a forward op outside a forward action")
        return act[1], act[2]

    def _slot(self, seg: _Segment) -> int:
        seg.slots += 1
        return seg.slots - 1

    def _new(self, t: GlobalTensor, entry: tuple) -> None:
        i, c = self._act()
        seg = self.segments.setdefault((i, c), _Segment())
        slot = self._slot(seg)
        seg.entries.append(entry + (slot,))
        self._remember(i, c, slot, t, t._local)

    def _remember(self, i: int, c: int, slot: int, t: Optional[GlobalTensor], local: torch.Tensor) -> None:
        if t is not None:
            self._by_id.setdefault(i, {})[id(t)] = (c, slot)
            self._keep.setdefault(i, []).append(t)
        by_data = self._by_data.setdefault(i, {})
        by_data[_storage_key(local)] = (c, slot)
        if local.is_contiguous():  # a message names its tensor by where its values start, flattened
            by_data[(local.data_ptr(), local.numel(), local.dtype)] = (c, slot)
        self._keep.setdefault(i, []).append(local)

    def _ref(self, t: GlobalTensor) -> Optional[int]:
        i, c = self._act()
        found = self._by_id.get(i, {}).get(id(t))
        if found is None and t._local.numel():
            local = t._local
            by_data = self._by_data.get(i, {})
            found = by_data.get(_storage_key(local))
            if found is None and local.is_contiguous():  # a received message viewed in its shape
                found = by_data.get((local.data_ptr(), local.numel(), local.dtype))
        if found is None:
            return None
        if found[0] != c:
            raise NotReplayable("a tensor goes from one of this rank's chunks into another")
        for r in self.segments[(i, c)].recvs:  # a received activation: its shape, whether it takes a gradient
            if r[0] == found[1]:
                r[5] = tuple(t._local.shape)
                r[7] = r[7] or t.requires_grad
        return found[1]

    def _filler(self, args: tuple, kwargs: dict) -> _Filler:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        i, c = self._act()
        seg = self.segments.setdefault((i, c), _Segment())
        values, refs, sig = list(leaves), [], []
        for k, v in enumerate(leaves):
            if isinstance(v, GlobalTensor):
                slot = self._ref(v)
                if slot is None:
                    if v.requires_grad or not v._local.numel():
                        raise NotReplayable("a tensor taking a gradient that no recorded call made (a parameter used "
                                            "outside its stage's modules?)")
                    values[k] = v._local
                    seg.constants.append(v._local)
                    sig.append(("const", tuple(v._local.shape), v._local.dtype))
                else:
                    values[k] = None
                    refs.append((k, slot))
                    sig.append(("slot", slot))
            elif isinstance(v, torch.Tensor):
                seg.constants.append(v)
                sig.append(("const", tuple(v.shape), v.dtype))
            else:
                sig.append(("value", v if isinstance(v, _VALUES) else id(v)))
        flat = not kwargs and all(not isinstance(a, (tuple, list, dict)) for a in args)
        return _Filler(values, refs, spec, flat, (tuple(sig), str(spec) if not flat else len(leaves)))

    def _outputs(self, entry: tuple, out: Any) -> None:
        i, c = self._act()
        seg = self.segments.setdefault((i, c), _Segment())
        leaves, spec = pytree.tree_flatten(out)
        slots = []
        for t in leaves:
            if isinstance(t, GlobalTensor):
                slot = self._slot(seg)
                self._remember(i, c, slot, t, t._local)
                slots.append(slot)
            else:
                slots.append(None)
        seg.entries.append(entry + (tuple(slots),))


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_stage(stage: Any) -> None:
    """A stage call a tape can replay: the module's class forward on plain tensors, nothing around it."""
    module = stage.module
    if not stage._runs_plain():
        raise NotReplayable(f"the stage {type(module).__name__} spans several ranks (it runs through the dispatcher)")
    for m in module.modules():
        group = m.__dict__.get("_gt_gather_group")
        if m.__dict__.get("_gt_layout_hooks") and (group is None or group.compute[0].placement != stage.placement):
            raise NotReplayable(f"the stage {type(module).__name__} has layout hooks (a weight converted on entry)")
    # its own gather's hooks (a tied weight kept for the step) are recorded around the call and run by the replay
    own = module.__dict__.get("_gt_gather_group")
    pre = [h for h in module._forward_pre_hooks.values() if getattr(h, "__self__", None) not in (stage, own)]
    post = [h for h in module._forward_hooks.values() if own is None or getattr(h, "__self__", None) is not own]
    glob = torch.nn.modules.module
    global_pre = [h for h in glob._global_forward_pre_hooks.values() if not getattr(h, "acts_on_reporting_threads", 0)]
    if pre or post or module._backward_hooks or module._backward_pre_hooks or global_pre or \
            glob._global_forward_hooks or glob._global_backward_hooks or glob._global_backward_pre_hooks:
        raise NotReplayable(f"the stage {type(module).__name__} has module hooks, which a replay would not run")


class Tapes:
    """This rank's tapes for one input signature, replayed action by action."""

    def __init__(self, segments: dict) -> None:
        self.segments = segments
        self._envs: dict = {}  # (micro-batch, chunk) -> the values of its forward, until its backward

    def same(self, other: "Tapes") -> bool:
        """Whether two steps recorded the same part (the plain tensors their forwards made equal by value)."""
        return self.segments.keys() == other.segments.keys() and all(
            self.segments[k].same(seg) for k, seg in other.segments.items())

    def why_not(self) -> str:
        """Why these tapes may not be replayed now (a hook registered on one of their stages since), or ""."""
        stages = {id(e[1]): e[1] for seg in self.segments.values() for e in seg.entries if e[0] == "call"}
        for stage in stages.values():
            try:
                _check_stage(stage)
            except NotReplayable as e:
                return str(e)
        return ""

    def forward(self, i: int, c: int, comm: Any, sources: dict, distribute: Callable) -> Any:
        """Chunk c of micro-batch i's forward; its loss (a GlobalTensor) where the forward ends here, else None.
        `sources`: the micro-batch's inputs (positional, keyword, the target) by the names `Recorder.source` was
        given."""
        seg = self.segments.get((i, c))
        if seg is None:
            return None
        env: list = [None] * seg.slots
        self._envs[(i, c)] = env
        for entry in seg.entries:
            kind = entry[0]
            if kind == "call":
                stage, fill, slots = entry[1], entry[2], entry[3]
                args, kwargs = fill(env)
                _put(env, slots, call_local(stage.module, stage._swaps(), args, kwargs))
            elif kind == "kernel":
                func, fill, slots = entry[1], entry[2], entry[3]
                args, kwargs = fill(env)
                _put(env, slots, func(*args, **kwargs))
            elif kind == "open":
                entry[1].before(entry[2], (), {})
            elif kind == "close":
                entry[1].after(entry[2], (), None)
            elif kind == "recv":
                slot, src, key, n, dtype, shape, device, grad, _ = seg.recvs[entry[1]]
                got = comm.exchange({}, {src: ((n,), dtype)}, None, device, key)[src].view(shape)
                env[slot] = got.requires_grad_() if grad else got
            elif kind == "send":
                slot, dst, key, _, _, device, _ = seg.sends[entry[1]]
                comm.exchange({dst: env[slot].detach().reshape(-1)}, {}, None, device, key)
            else:  # "source"
                _, which, layout, slot = entry
                env[slot] = distribute(sources[which], layout)._local
        keep = seg.kept
        for slot in range(len(env)):  # the rest is autograd's to keep (what it saved), not the tape's
            if slot not in keep:
                env[slot] = None
        loss = seg.loss
        if loss is None:
            return None
        if loss[0] == "value":
            return loss[1]
        _, slot, like = loss
        return like.with_local(env[slot].detach())

    def backward(self, i: int, c: int, comm: Any) -> None:
        """Chunk c of micro-batch i's backward: its sends' gradients received, autograd over the chunk, its receives'
        gradients sent back."""
        seg = self.segments.get((i, c))
        env = self._envs.pop((i, c), None)
        if seg is None or env is None:
            return
        roots, grads = [], []
        for slot, dst, _, n, dtype, device, bkey in seg.sends:
            roots.append(env[slot])
            grads.append(comm.exchange({}, {dst: ((n,), dtype)}, None, device, bkey)[dst].view(env[slot].shape))
        if seg.loss is not None and seg.loss[0] == "slot":
            t = env[seg.loss[1]]
            roots.append(t)
            grads.append(torch.ones_like(t))
        if roots:
            torch.autograd.backward(roots, grads)
        for slot, src, _, n, dtype, shape, device, grad, bkey in seg.recvs:
            if grad:
                g = env[slot].grad
                if g is None:
                    g = torch.zeros_like(env[slot])
                comm.exchange({src: g.reshape(-1)}, {}, None, device, bkey)

    def drop(self) -> None:
        self._envs.clear()


def give_empty_grads() -> None:
    """At a replayed step's end: a gather kept for the step that this rank ran outside the placement it computes
    on (the tied head's weight, sent from its stage), with no backward through it here, takes this rank's share of
    the gradients empty, as the program's backward gives it (`stage._Elsewhere`), so that the step's close reduces
    (receives) as there."""
    rank = context.current().rank
    for group in zero.kept_without_grads():
        if rank not in group.compute[0].placement:
            zero.add_kept_grads(group, tuple(
                GlobalTensor(torch.empty((0,), dtype=p.dtype, device=p._local.device), grad_layout(c), tuple(p.shape))
                if p.requires_grad else None for p, c in zip(group.params, group.compute)))


def _put(env: list, slots: tuple, out: Any) -> None:
    if len(slots) == 1 and isinstance(out, torch.Tensor):
        env[slots[0]] = out
        return
    for slot, t in zip(slots, pytree.tree_leaves(out)):
        if slot is not None:
            env[slot] = t


__all__ = ["NotReplayable", "Recorder", "RECORDING", "Tapes", "give_empty_grads", "recording"]
