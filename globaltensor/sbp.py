"""SBP values: how one mesh axis lays a tensor out over its ranks.

`Split(dim)` cuts `dim` like `numpy.array_split`, `Broadcast` replicates, and
`Partial(op)` means the global value is the `op`-reduction of the local values.
They are frozen and hashable because layouts (tuples of them) key every cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

REDUCE_OPS = ("sum", "max", "min")


@dataclass(frozen=True, slots=True)
class Split:
    """`S(dim)`: each rank of the mesh axis holds one `numpy.array_split` piece of `dim` (uneven and
    empty pieces are normal)."""
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"split(dim): dim must be an int, got {self.dim!r}")
        if self.dim < 0:
            raise ValueError(
                f"split(dim): dim must be >= 0, got {self.dim}; "
                "normalise a negative dim with dim % tensor.ndim first")

    def __repr__(self) -> str:
        return f"S({self.dim})"

    def __reduce__(self):  # unpickled through the constructor, so its checks run (torch.load too)
        return (Split, (self.dim,))


@dataclass(frozen=True, slots=True)
class Broadcast:
    """`B`: every rank of the mesh axis holds the whole tensor (the same values)."""

    def __repr__(self) -> str:
        return "B"

    def __reduce__(self):
        return (Broadcast, ())


@dataclass(frozen=True, slots=True)
class Partial:
    """`P(op)`: the global value is the `op`-reduction ("sum", "max" or "min") of the ranks' local values;
    what a row-parallel matmul or a gradient leaves before its all-reduce."""
    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise ValueError(f"partial(op): op must be one of {REDUCE_OPS}, got {self.op!r}")

    def __repr__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"

    def __reduce__(self):
        return (Partial, (self.op,))


@dataclass(frozen=True, slots=True)
class Ragged:
    """A Split of `dim` whose per-rank sizes are data (dropless MoE's tokens per expert), not structure.

    The sizes are not part of this value, so layouts, decisions and routes stay keyed on structure;
    the tensor carries them (`globaltensor/raggedtensor/ops.py`), the same on every rank of the mesh axis.
    """
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"ragged(dim): dim must be an int >= 0, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"R({self.dim})"

    def __reduce__(self):
        return (Ragged, (self.dim,))


@dataclass(frozen=True, slots=True)
class Zigzag:
    """A Split of `dim` for causal attention: cut into 2n chunks, rank i holds chunks i and 2n-1-i.

    Its own type, not a flag on `Split`: every `isinstance(s, Split)` in rules, routes and shard
    arithmetic means "one contiguous range", which a zigzag shard is not; as a separate value the code
    that does not know it cannot take it for a contiguous split (it refuses, or the tensor's ops box it
    to `Split(dim)` first). Each rank holds as many rows as under `Split(dim)` (`zigzag_ranges`), so
    local shapes, and the bytes of every conversion, are those of the contiguous split.
    """
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"zigzag(dim): dim must be an int >= 0, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Z({self.dim})"

    def __reduce__(self):
        return (Zigzag, (self.dim,))


@dataclass(frozen=True, slots=True)
class Strided:
    """A Split of `dim` viewed as `groups` contiguous blocks, each block split over the mesh axis: rank i
    holds piece i of every block, the blocks in order (DTensor's `_StridedShard`; transformers'
    "packed_colwise": a fused gate_up projection [2I, hidden] whose rank holds its slice of gate AND of up).

    Its own type, not a flag on `Split`, for the reason `Zigzag` is: every `isinstance(s, Split)` means one
    contiguous range, which a strided piece is not (it is `groups` ranges); code that does not know it
    refuses, or the tensor's ops (`ops/strided_split.py`) box it to `Split(dim)` first. `groups=1` is
    `Split(dim)`: build it with `gt.strided`, which returns that.
    """
    dim: int
    groups: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"strided(dim, groups): dim must be an int >= 0, got {self.dim!r}")
        if not isinstance(self.groups, int) or isinstance(self.groups, bool) or self.groups < 2:
            raise ValueError(f"strided(dim, groups): groups must be an int >= 2 (1 is gt.split(dim)), "
                             f"got {self.groups!r}")

    def __repr__(self) -> str:
        return f"S({self.dim}, groups={self.groups})"

    def __reduce__(self):
        return (Strided, (self.dim, self.groups))


SBP = Union[Split, Broadcast, Partial, Ragged, Zigzag, Strided]
# What an `sbp` argument accepts: one SBP (a 1-D placement) or one per mesh axis, in mesh-axis order.
SbpLike = Union[SBP, Sequence[SBP]]
SBP_TYPES = (Split, Broadcast, Partial)   # what a plan, a factory or an op may name
LAYOUT_TYPES = SBP_TYPES + (Ragged, Zigzag, Strided)  # what a Layout may hold: ragged, zigzag, strided tensors' too


def split(dim: int) -> Split:
    """`S(dim)`, a mesh axis cutting tensor dim `dim` (>= 0) into `numpy.array_split` pieces."""
    return Split(dim)


def ragged(dim: int) -> Ragged:
    """`R(dim)`, a split of `dim` whose per-rank sizes the tensor carries (`from_local(..., sizes=)`)."""
    return Ragged(dim)


def zigzag(dim: int) -> Zigzag:
    """`Z(dim)`, causal attention's load-balanced split: rank i of n holds chunks i and 2n-1-i of 2n."""
    return Zigzag(dim)


def strided(dim: int, groups: int) -> Union[Split, Strided]:
    """`S(dim, groups=g)`: dim viewed as `groups` equal contiguous blocks, each split over the mesh axis
    (rank i holds piece i of every block); `groups=1` is `Split(dim)`."""
    if groups == 1:
        return Split(dim)
    return Strided(dim, groups)


def strided_ranges(length: int, groups: int, parts: int, index: int) -> tuple[tuple[int, int], ...]:
    """The (start, size) ranges piece `index` of `parts` holds of a dim of `length` cut strided into
    `groups` blocks: `split_range` of each block, in block order."""
    block = length // groups
    return tuple((g * block + start, size) for g in range(groups)
                 for start, size in (split_range(block, parts, index),))


def strided_order(length: int, groups: int, parts: int) -> list[int]:
    """The global rows in the order the ranks hold them (rank 0's ranges, then rank 1's, ...): `x[order]`
    laid out as `Split` is `x` laid out as `Strided` where every block divides evenly by `parts`."""
    return [start + k for i in range(parts) for start, size in strided_ranges(length, groups, parts, i)
            for k in range(size)]


def partial(op: str = "sum") -> Partial:
    """`P(op)`, the global value is the `op`-reduction of the locals; `op` is "sum", "max" or "min"."""
    return Partial(op)


broadcast = Broadcast()
partial_sum = Partial("sum")


# -- a Split's pieces: numpy.array_split-balanced, sizes differ by at most one --------------------
def split_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of piece `index` of `length` cut into `parts` as numpy.array_split does."""
    base, extra = divmod(length, parts)
    return index * base + min(index, extra), base + (index < extra)


def split_sizes(length: int, parts: int) -> list[int]:
    """The sizes of all `parts` pieces of `length`, as numpy.array_split cuts it."""
    base, extra = divmod(length, parts)
    return [base + (i < extra) for i in range(parts)]


# -- a Zigzag's pieces: rank i's rows are chunks i and 2n-1-i of 2n, as many as Split gives it ------
def zigzag_ranges(length: int, parts: int, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((start, size), (start, size)) of the two chunks rank `index` of `parts` holds, in global order.

    Rank i holds `split_sizes(length, parts)[i]` rows: the larger half as chunk i, the rest as chunk
    2n-1-i, so a causal query block sees about as many keys on every rank (the load balance) while
    shapes stay those of `Split`.
    """
    sizes = split_sizes(length, parts)
    chunks = [n - n // 2 for n in sizes] + [n // 2 for n in reversed(sizes)]
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    late = 2 * parts - 1 - index
    return (starts[index], chunks[index]), (starts[late], chunks[late])


def zigzag_order(length: int, parts: int) -> list[int]:
    """The global rows in zigzag order: rank 0's two chunks, then rank 1's, ... (`x[order]` laid out
    as `Split` is `x` laid out as `Zigzag`)."""
    order: list[int] = []
    for i in range(parts):
        for start, size in zigzag_ranges(length, parts, i):
            order.extend(range(start, start + size))
    return order


def zigzag_order_of(pieces: tuple[tuple[int, int], ...], parts: int) -> list[int]:
    """`zigzag_order` within each (start, size) piece of a dim, the pieces in turn: the zigzag order of
    a dim that earlier mesh axes cut first (each piece is zigzag-cut by the zigzag axis)."""
    return [start + i for start, size in pieces for i in zigzag_order(size, parts)]
