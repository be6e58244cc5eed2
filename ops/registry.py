"""Rules as data: an op's 1-D signatures (input SBPs -> output SBPs on one mesh axis).

A rule's `signatures(ctx)` lists what one mesh axis may do; all-Broadcast is
implied for every op. `kernel` is what runs on the local shards (default: the
op itself); it only needs writing where a shard must know where it sits
(view sizes, vocab offsets). `decompose` marks ops that are run as several
other dispatched ops (the `_foreach_*` family) rather than as one kernel;
with `decompose_when`, only for the input layouts it accepts (a softmax over
a split dim), the signatures deciding the others. `scalar_key` says what the
signatures read of float arguments (see `ops/keys.py`). `kernel_cost` charges
what a local kernel sends itself. `meta` may stand in for
torch's meta kernel when a decision infers output shapes and dtypes (torch's
elementwise meta kernels are Python references, slow on a cache miss).
"""
from __future__ import annotations

from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..sbp import SBP, Broadcast, Partial, Split

aten = torch.ops.aten
B = Broadcast()
P = Partial("sum")
PMAX = Partial("max")
PMIN = Partial("min")
S = Split

Signature = tuple[tuple[SBP, ...], tuple[SBP, ...]]  # (one SBP per tensor input, one per tensor output)


@dataclass(frozen=True)
class Ctx:
    """What a rule may look at: global shapes of the tensor inputs (in argument order), the outputs', and args."""
    func: Any
    shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[Optional[tuple[int, ...]], ...]
    args: tuple
    kwargs: dict
    mesh: tuple[int, ...]
    # per output: its (strides, storage offset) on one device (`keys.geometry_of`; None: contiguous)
    out_geometry: Optional[tuple] = None

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Positional or keyword argument of the op's schema."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def named(self, name: str, default: Any = None) -> Any:
        """The argument called `name` in the op's schema, wherever it sits."""
        for i, a in enumerate(self.func._schema.arguments):
            if a.name == name:
                return self.arg(i, name, default if a.default_value is None else a.default_value)
        return default


@dataclass(frozen=True)
class ShardSite:
    """What a local kernel gets besides the local args: where this rank's shards sit."""
    ctx: Ctx
    in_layouts: tuple
    out_layouts: tuple
    rank: int
    # the dispatcher runs the kernel on meta shards of a representative rank to check its output shapes:
    # a kernel that communicates itself (ring attention) must then only compute shapes
    checking: bool = False

    def out_shape(self, i: int = 0) -> tuple[int, ...]:
        """This rank's shard shape of output i (worked out once: a view's every call asks for it)."""
        shapes = self.__dict__.get("_out_shapes")
        if shapes is None:
            shapes = {}
            object.__setattr__(self, "_out_shapes", shapes)
        shape = shapes.get(i)
        if shape is None:
            shape = shapes[i] = self.out_layouts[i].local_shape(self.ctx.out_shapes[i], self.rank)
        return shape

    def in_box(self, i: int) -> tuple[tuple[int, int], ...]:
        return self.in_layouts[i].shard(self.ctx.shapes[i], self.rank)

    def out_box(self, i: int = 0) -> tuple[tuple[int, int], ...]:
        return self.out_layouts[i].shard(self.ctx.out_shapes[i], self.rank)


@dataclass(frozen=True)
class Rule:
    signatures: Callable[[Ctx], Sequence[Signature]]
    kernel: Optional[Callable[..., Any]] = None  # kernel(func, args, kwargs, where: ShardSite) -> outputs
    decompose: Optional[Callable[..., Any]] = None  # decompose(func, args, kwargs) -> outputs (dispatched)
    decompose_when: Optional[Callable[..., bool]] = None  # (ctx, input layouts) -> bool; None: always
    fresh: bool = False  # outputs hold no values yet (empty-like): a later overwrite may relayout them
    # a view op whose kernel computes into new memory (a conjugate resolved into the shard; a cut of a split dim,
    # its rows moved between ranks: a recut, `ops/view.py`): its outputs alias nothing, so a write into them is
    # refused as into any cut view (`ops/program.refuse_cut`). True, or unaliased(ctx, input layouts, output
    # layouts) -> bool
    unaliased: Union[bool, Callable[[Ctx, tuple, tuple], bool]] = False
    # an input the op had converted keeps the converted shard and layout, where it is an intermediate
    # (autograd non-leaf): what autograd saved for the backward is then what the kernel used, so the backward
    # does not convert it again (Ulysses' q, k, v). For ops whose outputs do not alias their inputs
    keep_converted_inputs: bool = False
    overwrites: bool = False  # writes every element of its target (copy_): may relayout a fresh target
    meta: Optional[Callable[..., Any]] = None  # meta(func, args, kwargs): func's outputs on meta tensors, faster
    # what the signatures read of the op's float arguments (masked_fill: is the fill zero); the decision
    # cache keys on it. Floats are otherwise not part of a decision (a learning rate changes every step)
    scalar_key: Optional[Callable[[tuple, dict], Any]] = None
    # what the kernel itself communicates, which the boxing of its inputs does not show (ring attention passes
    # key/value blocks between ranks): kernel_cost(ctx, sources, targets, out_layouts) -> (bytes received per
    # global rank, collectives), added to the choice's cost; None: this choice is not to be taken
    kernel_cost: Optional[Callable[[Ctx, tuple, tuple, tuple], Optional[tuple]]] = None
    # for a rule with a `kernel`: whether, under these layouts, the kernel computes what the op itself computes on
    # the shards when the sizes in its arguments are read off them (a view's only restates sizes for the
    # shard). A module whose ops are all so may run on its plain local tensors (`globaltensor/parallel/plain.py`); a kernel
    # that must know where its shard sits (vocab offsets, a global count, causal rows) says False or leaves None.
    # plain_when(ctx, input layouts, output layouts) -> bool
    plain_when: Optional[Callable[[Ctx, tuple, tuple], bool]] = None


RULES: dict[Any, Rule] = {}


@lru_cache(maxsize=None)
def is_inplace(func: Any) -> bool:
    """Whether `func` writes its first argument and returns it (add_, copy_), from its schema."""
    s = func._schema
    return bool(s.arguments) and s.arguments[0].is_out is False and s.arguments[0].alias_info is not None \
        and s.arguments[0].alias_info.is_write and not s.name.endswith("_foreach") and bool(s.returns) \
        and s.returns[0].alias_info is not None and s.returns[0].alias_info.is_write


def register(ops: Sequence[Any], rule: Rule) -> None:
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                RULES[getattr(op, name)] = rule
        else:
            RULES[op] = rule


@lru_cache(maxsize=None)
def aten_overloads() -> tuple:
    """Every aten overload this torch build has (walked once: rules derived from schemas and tags read it)."""
    found = []
    for name in dir(aten):
        try:
            packet = getattr(aten, name)
        except Exception:  # noqa: BLE001 - a packet torch lists but cannot load
            continue
        if isinstance(packet, torch._ops.OpOverloadPacket):
            found += [getattr(packet, o) for o in packet.overloads()]
    return tuple(found)


def writes_out(op: Any) -> bool:
    """Whether `op` is an `out=` overload."""
    return any(a.is_out for a in op._schema.arguments)


def overloads(*names: str) -> list:
    """aten packets by name, skipping the ones this torch build does not have."""
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def pointwise_dims(shape: Sequence[int], out_shape: Sequence[int], out_dim: int) -> Optional[SBP]:
    """The SBP an input broadcast to `out_shape` needs when the output is split on `out_dim`."""
    d = out_dim - (len(out_shape) - len(shape))
    if d < 0 or shape[d] != out_shape[out_dim]:
        return B  # absent or size-1 broadcast dim: every rank needs the whole
    return S(d)


def reduce_partial(t: Any) -> Any:
    """A GlobalTensor's Partial mesh axes reduced to Broadcast (for rules that decompose an op).

    A plain tensor comes back as it is: mixed with GlobalTensors it is taken as Broadcast, so it
    is already whole on every rank (a decomposition's intermediate is plain when all its inputs
    were, e.g. the count of scored targets of a plain target beside Partial logits)."""
    if not hasattr(t, "placement") or not any(isinstance(s, Partial) for s in t.sbp):
        return t  # nothing to reduce (a ragged axis is kept as it is, sizes and all)
    return t.to_global(t.placement, tuple(B if isinstance(s, Partial) else s for s in t.sbp))


def split_on(layout: Any, dim: int) -> bool:
    """Whether some mesh axis of `layout` splits tensor dim `dim`."""
    return any(isinstance(s, Split) and s.dim == dim for s in layout.sbp)


def always(*_: Any) -> bool:
    return True


def no_signatures(ctx: Ctx) -> list:
    return []


__all__ = ["Ctx", "ShardSite", "Rule", "RULES", "aten_overloads", "writes_out", "is_inplace", "register", "overloads", "pointwise_dims", "Signature",
           "B", "P", "PMAX", "PMIN", "S", "aten", "always", "field", "no_signatures", "reduce_partial", "split_on"]
