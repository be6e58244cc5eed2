"""The communicator's collectives as graph ops, for `torch.compile` over global programs.

Under `torch.compile` the dispatcher runs at trace time on fake shards (dynamo's example values, then
AOTAutograd's functional tensors), and whatever it calls on them becomes the graph. A collective there must
not talk to the other ranks (there are no values, and a simulated rank tracing alone would wait forever for
the others); it must be recorded. So each `Communicator` primitive, handed a traced tensor, calls one of the
ops below instead: `torch.library` custom ops with fake implementations (shapes only) whose real
implementation, when the compiled graph runs, is the same primitive on the running rank's communicator
(`context.current()`: the simulator's rank thread, or the torch.distributed process). One mechanism for both
runtimes: the simulator runs compiled programs on its rank threads, `gt.comm_log()` counts the bytes as in
eager mode, and the graph lists the collectives by name (`globaltensor.all_reduce` ...).

What has no graph op raises at trace time (`untraceable`): point-to-point exchanges (pipelines), broadcasts
and the small-object all-gathers that data-dependent shapes need. Dynamo reports such an error as a graph
break (or, with `fullgraph=True`, raises it), never as a silently different value.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

_TRACED = (FakeTensor, FunctionalTensor)


def traced(t: object) -> bool:
    """Whether `t` is a shard seen while tracing (fake, or functionalized by AOTAutograd): no values to send."""
    return isinstance(t, _TRACED)


_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
_get_mode = torch._C._get_dispatch_mode


def tracing_now() -> bool:
    """Whether torch.compile is tracing on this thread (for calls handed no tensor to tell by): dynamo's and
    AOTAutograd's tracing both run under a fake tensor mode. One C call: `send_buffer` asks on every call."""
    return _get_mode(_FAKE_MODE) is not None


def compiling() -> bool:
    """`tracing_now`, or dynamo is compiling a frame on this thread (for rare calls: a dict lookup more)."""
    return tracing_now() or torch._guards.TracingContext.try_get() is not None


def untraceable(kind: str) -> RuntimeError:
    return RuntimeError(
        f"{kind} cannot be captured in a torch.compile graph (globaltensor records all_gather, reduce_scatter, "
        "all_reduce and all_to_all as graph ops; point-to-point exchanges, broadcasts and the shape all-gathers "
        "of data-dependent ops have none): run this part eagerly (torch.compiler.disable) or without compile")


class _Current:
    """Where the running rank's communicator is found: `context.current`, set by `runtime/context.py` (which
    imports the communicators, which import this module, so it is handed over rather than imported)."""

    find: Callable[[], Any] | None = None


CURRENT = _Current()


def _comm() -> Any:
    return CURRENT.find()


def _unaliased(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """A custom op's output may not share memory with its inputs (a group's own piece is the input itself)."""
    ptr = out.untyped_storage().data_ptr()
    if out.numel() and any(i.numel() and i.untyped_storage().data_ptr() == ptr for i in inputs):
        return out.clone()
    return out


def _shapes(flat: Sequence[int], ndim: int) -> list[tuple[int, ...]]:
    return [tuple(flat[k:k + ndim]) for k in range(0, len(flat), ndim)] if ndim else [()] * (len(flat) or 0)


@torch.library.custom_op("globaltensor::all_gather", mutates_args=())
def all_gather(t: torch.Tensor, group: list[int], shapes: list[int], ndim: int, members: int) -> list[torch.Tensor]:
    """Every member's piece in group order; `shapes` flattened (`ndim` numbers per member, uneven allowed)."""
    pieces = _shapes(shapes, ndim) if ndim else [()] * members
    return [_unaliased(o, t) for o in _comm().all_gather(t, tuple(group), pieces)]


@all_gather.register_fake
def _(t, group, shapes, ndim, members):
    pieces = _shapes(shapes, ndim) if ndim else [()] * members
    return [t.new_empty(s) for s in pieces]


@torch.library.custom_op("globaltensor::reduce_scatter", mutates_args=())
def reduce_scatter(chunks: list[torch.Tensor], group: list[int], op: str, index: int) -> torch.Tensor:
    """chunks[j] is this rank's contribution to member j; this rank (member `index`) gets its chunk reduced."""
    return _unaliased(_comm().reduce_scatter(chunks, tuple(group), op), *chunks)


@reduce_scatter.register_fake
def _(chunks, group, op, index):
    return torch.empty_like(chunks[index], memory_format=torch.contiguous_format)


@torch.library.custom_op("globaltensor::all_reduce", mutates_args=())
def all_reduce(t: torch.Tensor, group: list[int], op: str) -> torch.Tensor:
    return _unaliased(_comm().all_reduce(t, tuple(group), op), t)


@all_reduce.register_fake
def _(t, group, op):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@torch.library.custom_op("globaltensor::all_to_all", mutates_args=())
def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: list[int]) -> torch.Tensor:
    """Flat all-to-all: segment j of `send` goes to member j; the result holds what each member sent here."""
    recv = send.new_empty(sum(recv_splits))
    return _comm().all_to_all_into(send, send_splits, recv, recv_splits, tuple(group))


@all_to_all.register_fake
def _(send, send_splits, recv_splits, group):
    return send.new_empty(sum(recv_splits))


def gather(t: torch.Tensor, group: tuple, shapes: Sequence[tuple]) -> list[torch.Tensor]:
    ndim = len(shapes[0])
    return list(torch.ops.globaltensor.all_gather(t, list(group), [int(n) for s in shapes for n in s], ndim,
                                                  len(group)))


def scatter_reduce(chunks: Sequence[torch.Tensor], group: tuple, op: str, index: int) -> torch.Tensor:
    return torch.ops.globaltensor.reduce_scatter(list(chunks), list(group), op, index)


def reduce(t: torch.Tensor, group: tuple, op: str) -> torch.Tensor:
    return torch.ops.globaltensor.all_reduce(t, list(group), op)


def to_all(send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: tuple) -> torch.Tensor:
    return torch.ops.globaltensor.all_to_all(send, [int(s) for s in send_splits], [int(s) for s in recv_splits],
                                             list(group))
