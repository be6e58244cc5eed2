"""Re-cutting one dim across one mesh axis with sizes given per rank (ragged splits).

A ragged split and a balanced one of the same dim are both contiguous ranges in rank order, so
member i sends member j exactly the overlap of its range with j's: one uneven all-to-all in which
every rank receives what its target range holds and its source range does not, the lower bound.
The sizes are data, known on every rank of the axis (the tensor carries them), so nothing here is
planned or cached: the arithmetic is a few additions per peer.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def overlaps(src: Sequence[int], dst: Sequence[int]) -> list[list[int]]:
    """rows[i][j]: how many rows of member i's source range fall in member j's target range."""
    s_off = [0]
    for n in src:
        s_off.append(s_off[-1] + n)
    d_off = [0]
    for n in dst:
        d_off.append(d_off[-1] + n)
    return [[max(0, min(s_off[i + 1], d_off[j + 1]) - max(s_off[i], d_off[j])) for j in range(len(dst))]
            for i in range(len(src))]


def recut(local: torch.Tensor, dim: int, src: Sequence[int], dst: Sequence[int], group: Sequence[int],
          comm: Any) -> torch.Tensor:
    """This member's rows of `dim` re-cut from sizes `src` to sizes `dst` over `group` (one all-to-all).

    The moved dim goes first so that each peer's rows are one contiguous segment of the send buffer;
    for dim 0 (tokens) that costs no copy.
    """
    if sum(src) != sum(dst):
        raise ValueError(f"ragged conversion: source sizes {list(src)} and target sizes {list(dst)} add up to "
                         "different lengths")
    me = group.index(comm.rank)
    rows = overlaps(src, dst)
    moved = local.movedim(dim, 0) if dim else local
    rest = tuple(moved.shape[1:])
    per_row = 1
    for n in rest:
        per_row *= n
    send = moved.contiguous().reshape(-1)
    recv_rows = [rows[i][me] for i in range(len(group))]
    recv = send.new_empty(sum(recv_rows) * per_row)
    if hasattr(comm, "receives"):  # a symmetric dry run (runtime/symmetry.py): what every member receives
        comm.receives = lambda g, j: [rows[i][j] * per_row for i in range(len(g))]
    comm.all_to_all_into(send, [n * per_row for n in rows[me]], recv, [n * per_row for n in recv_rows],
                         tuple(group))
    out = recv.view((sum(recv_rows),) + rest)
    return out.movedim(0, dim).contiguous() if dim else out


def moves(src: Sequence[int], dst: Sequence[int]) -> bool:
    """Whether `swap` between these sizes changes any rows' hands in the group."""
    return any(src[i] and dst[j] for i in range(len(src)) for j in range(len(dst)) if i != j)


def swap(local: torch.Tensor, src_dim: int, src: Sequence[int], dst_dim: int, dst: Sequence[int],
         group: Sequence[int], comm: Any, run: bool | None = None) -> torch.Tensor:
    """This member's block re-cut from sizes `src` along `src_dim` (`dst_dim` whole) to sizes `dst` along
    `dst_dim` (`src_dim` whole): one all-to-all in which member i sends member j its rows of src_dim
    within j's range of dst_dim, so every member receives what its target block holds and its source
    block does not (a ragged dim to a split of another and back: MoE's dispatch and combine). `run`:
    whether to run the collective (default: where anything changes hands in this group)."""
    me = group.index(comm.rank)
    off = [0]
    for n in dst:
        off.append(off[-1] + n)
    if not (moves(src, dst) if run is None else run):
        return local.narrow(dst_dim, off[me], dst[me])   # nothing changes hands: no collective
    pieces = [local.narrow(dst_dim, off[j], dst[j]) for j in range(len(group))]
    shapes = [tuple(src[i] if d == src_dim else dst[me] if d == dst_dim else n for d, n in enumerate(local.shape))
              for i in range(len(group))]
    return torch.cat(comm.all_to_all(pieces, tuple(group), shapes), src_dim)


def gather(local: torch.Tensor, dim: int, sizes: Sequence[int], group: Sequence[int], comm: Any) -> torch.Tensor:
    """Every member's rows of `dim` on every member (ragged -> Broadcast): one uneven all-gather."""
    shapes = [tuple(n if d == dim else s for d, s in enumerate(local.shape)) for n in sizes]
    return torch.cat(comm.all_gather(local, tuple(group), shapes), dim)


def take(full: torch.Tensor, dim: int, sizes: Sequence[int], index: int) -> torch.Tensor:
    """Member `index`'s rows of `full` along `dim` (Broadcast -> ragged: a local slice)."""
    return full.narrow(dim, sum(sizes[:index]), sizes[index])


__all__ = ["overlaps", "recut", "moves", "swap", "gather", "take"]
