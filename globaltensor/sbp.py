"""SBP values: how one mesh axis lays a tensor out over its ranks.

`Split(dim)` cuts `dim` like `numpy.array_split`, `Broadcast` replicates, and
`Partial(op)` means the global value is the `op`-reduction of the local values.
They are frozen and hashable because layouts (tuples of them) key every cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

REDUCE_OPS = ("sum", "max", "min")


@dataclass(frozen=True, slots=True)
class Split:
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
    def __repr__(self) -> str:
        return "B"

    def __reduce__(self):
        return (Broadcast, ())


@dataclass(frozen=True, slots=True)
class Partial:
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

    The sizes are not part of this value, so layouts, decisions and plans stay keyed on structure;
    the tensor carries them (`globaltensor/ragged.py`), the same on every rank of the mesh axis.
    """
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"ragged(dim): dim must be an int >= 0, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"R({self.dim})"

    def __reduce__(self):
        return (Ragged, (self.dim,))


SBP = Union[Split, Broadcast, Partial, Ragged]
SBP_TYPES = (Split, Broadcast, Partial)   # what a plan, a factory or an op may name
LAYOUT_TYPES = SBP_TYPES + (Ragged,)      # what a Layout may hold: a ragged tensor's too


def split(dim: int) -> Split:
    return Split(dim)


def ragged(dim: int) -> Ragged:
    return Ragged(dim)


def partial(op: str = "sum") -> Partial:
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
