"""What a GlobalTensor stores in a torch.distributed.checkpoint (DCP) checkpoint: its chunks.

DCP asks each tensor of a state dict three things (its `_Checkpointable` protocol, the one
DTensor implements): which chunks this rank writes (`write_items`), which chunks this rank
holds and wants filled on load (`chunk_list`), and the local tensor behind a chunk
(`tensor_shard`). A chunk is a box of the global tensor: `Layout.shard` gives it, or, where a
rank holds several ranges of a dim (a strided split: one per block; a zigzag: two), `Layout.ranges`
gives one chunk per combination of ranges, each a view of its place in the local shard.

Every element is written exactly once, decided here, on each rank, with no communication:

- a Broadcast axis holds replicas; exactly one replica writes each chunk. Which one is spread
  over the replicas by a stable hash of the key and the chunk, so a model of Broadcast weights
  does not land on rank 0 alone (DCP's own deduplication would also drop replicas, but only
  with its global planning step; deciding locally keeps `use_collectives=False` correct too);
- an empty shard (uneven splits, small tensors, ranks outside the placement) writes nothing,
  except that a tensor with no elements at all is written once, so that its key and shape
  are in the checkpoint;
- a Partial axis is refused: its ranks hold terms of a sum, not pieces of the value, and the
  reduction it needs is a collective, which has no place inside DCP's planning. Reduce first
  (`x.to_global(sbp=...)`); DTensor refuses Partial the same way.

On load the chunk list is this rank's box under the *destination* layout, so DCP reads only
the saved chunks that overlap it: resharding to any mesh, plan or world size for free.

On the simulator DCP sees no process group and runs as a world of one on every rank thread;
`globaltensor.checkpoint`'s planner and writer then do the coordination over our
communicator and mark it here (`coordinated`), so a plain `dcp.save` there fails clearly
instead of letting every rank write the same file names.

DCP's classes are imported inside the functions: DCP is the caller, so they are loaded by
then, and `import globaltensor` does not pay DCP's import (about 0.7 s) for programs that
never checkpoint.
"""
from __future__ import annotations

import contextlib
import threading
import zlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .layout import Layout, slice_box
from .runtime import context
from .sbp import Broadcast


class _Coordination(threading.local):
    active: bool = False  # set by globaltensor.checkpoint's planner while it plans a save


_coordination = _Coordination()


@contextlib.contextmanager
def coordinated() -> Iterator[None]:
    """Mark the calling rank's save as coordinated over our communicator (see the module docstring)."""
    before = _coordination.active
    _coordination.active = True
    try:
        yield
    finally:
        _coordination.active = before


def _refuse_partial(layout: Layout, what: str) -> None:
    if layout.has_partial:
        raise ValueError(
            f"{what}: a GlobalTensor with a Partial axis {layout} cannot be checkpointed: its ranks hold terms "
            "of a sum, not pieces of the value. Reduce it first, e.g. x.to_global(sbp=...) with Broadcast or "
            "Split in place of Partial")


def _writes(fqn: str, layout: Layout, rank: int, box: tuple[tuple[int, int], ...]) -> bool:
    """Whether `rank` is the one replica of `box` that writes it: the replicas are the ranks whose
    coordinates differ on Broadcast axes only, and the key and the box pick one of them."""
    p = layout.placement
    coord = p.coord(rank)
    replica, replicas = 0, 1
    for axis, s in enumerate(layout.sbp):
        if isinstance(s, Broadcast):
            replica, replicas = replica * p.shape[axis] + coord[axis], replicas * p.shape[axis]
    if replicas == 1:
        return True
    key = f"{fqn}|{tuple(start for start, _ in box)}".encode()
    return replica == zlib.crc32(key) % replicas


def _has_no_elements(shape: tuple[int, ...]) -> bool:
    return any(n == 0 for n in shape)


def _chunk(box: tuple[tuple[int, int], ...]) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    return ChunkStorageMetadata(offsets=torch.Size(start for start, _ in box),
                                sizes=torch.Size(size for _, size in box))


def _check_coordinated() -> None:
    comm = context.current()
    if comm.world_size > 1 and not (dist.is_available() and dist.is_initialized()) and not _coordination.active:
        raise RuntimeError(
            "dcp.save of a GlobalTensor on the simulator: DCP sees no process group here and would let every "
            "rank write the same files. Use globaltensor.checkpoint.save(state_dict, path), or pass "
            "planner=globaltensor.checkpoint.SavePlanner() and "
            "storage_writer=globaltensor.checkpoint.FileSystemWriter(path) to dcp.save")


def _pieces(layout: Layout, shape: tuple[int, ...], rank: int) -> list[tuple[tuple, tuple]] | None:
    """(box of the global tensor, box of the local shard) of every chunk `rank` holds, None outside the
    placement: one per combination of each dim's ranges (`Layout.ranges`), in the order the shard holds them."""
    ranges = layout.ranges(shape, rank)
    if ranges is None:
        return None
    out: list[tuple[tuple, tuple]] = [((), ())]
    for rs in ranges:
        options, at = [], 0
        for start, n in rs:
            options.append(((start, n), (at, n)))
            at += n
        out = [(g + (o[0],), l + (o[1],)) for g, l in out for o in options]
    return out


def write_items(fqn: str, local: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> list:
    """DCP's WriteItems for this rank: each of its chunks of which it is the writer."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    _refuse_partial(layout, f"dcp.save of {fqn!r}")
    _check_coordinated()
    rank = context.current().rank
    pieces = _pieces(layout, shape, rank)
    if pieces is None:
        return []
    items = []
    for i, (box, _) in enumerate(pieces):
        if _has_no_elements(shape):  # written once, by the placement's first rank, for its key and shape
            if rank != layout.placement.flat_ranks[0] or i:
                continue
        elif any(size == 0 for _, size in box) or not _writes(fqn, layout, rank, box):
            continue
        chunk = _chunk(box)
        items.append(WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(chunk=chunk,
                                                           properties=TensorProperties.create_from_tensor(local),
                                                           size=torch.Size(shape))))
    return items


def chunk_list(local: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> list:
    """The chunks this rank holds (to be filled on load); none when it holds no element."""
    _refuse_partial(layout, "dcp.load")
    pieces = _pieces(layout, shape, context.current().rank) or []
    return [_chunk(box) for box, _ in pieces if all(size for _, size in box)]


def tensor_shard(local: torch.Tensor, layout: Layout, shape: tuple[int, ...], index: Any) -> torch.Tensor:
    """The local tensor behind the chunk DCP names by `index` (written from, or read into in place): the
    whole shard where it is one chunk, else a view of the chunk's place in it."""
    _refuse_partial(layout, f"dcp of {index.fqn!r}")
    pieces = _pieces(layout, shape, context.current().rank)
    if pieces is not None and len(pieces) == 1 and (index.offset is None or tuple(index.offset) == tuple(
            s for s, _ in pieces[0][0])):
        return local
    for box, at in pieces or ():
        if index.offset is not None and tuple(index.offset) == tuple(s for s, _ in box):
            return slice_box(local, at)
    raise ValueError(f"dcp: rank {context.current().rank} holds no chunk of {index.fqn!r} at offset "
                     f"{None if index.offset is None else tuple(index.offset)} (it holds "
                     f"{None if pieces is None else [b for b, _ in pieces]} of {layout})")


__all__ = ["coordinated", "write_items", "chunk_list", "tensor_shard"]
