"""Layout = placement + one SBP per mesh axis, and the shard arithmetic it implies.

Where several mesh axes split the same dim, mesh axis 0 cuts first and each
later axis cuts that piece further; every cut is `numpy.array_split`-balanced,
so shards differ by at most one element and may be empty.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from .placement import Placement
from .sbp import (LAYOUT_TYPES, SBP, Broadcast, Partial, Ragged, Split, Strided, Zigzag, split_range, split_sizes,
                  strided_order, strided_ranges, zigzag_order_of, zigzag_ranges)


def normalize_sbp(sbp: object, ndim: int, arg: str = "sbp") -> tuple[SBP, ...]:
    """A single SBP stands for a 1-D placement's tuple; anything else must match the mesh."""
    if isinstance(sbp, LAYOUT_TYPES):
        if ndim != 1:
            raise ValueError(f"{arg}: a single SBP {sbp!r} is only accepted for a 1-D placement; "
                             f"give a tuple of {ndim} SBPs, one per mesh axis")
        return (sbp,)
    if not isinstance(sbp, (tuple, list)):
        raise TypeError(f"{arg}: expected an SBP or a tuple of SBPs (gt.split(d), gt.broadcast, "
                        f"gt.partial_sum), got {type(sbp).__name__}")
    if len(sbp) != ndim:
        raise ValueError(f"{arg}: has {len(sbp)} entries but the placement mesh has {ndim} axes; "
                         f"give one SBP per mesh axis")
    for s in sbp:
        if not isinstance(s, LAYOUT_TYPES):
            raise TypeError(f"{arg}: {s!r} is not an SBP; use gt.split(d), gt.broadcast or gt.partial(op)")
    return tuple(sbp)


@dataclass(frozen=True)
class Layout:
    """Where a tensor lives: a placement and one SBP per mesh axis (a single SBP for a 1-D placement).

    Immutable and hashed once, because layouts key every route and dispatch cache; `x.global_layout` is a
    GlobalTensor's (torch's own `x.layout` is `torch.strided`).
    """
    placement: Placement
    sbp: tuple[SBP, ...]

    def __init__(self, placement: Placement, sbp: object) -> None:
        if not isinstance(placement, Placement):
            raise TypeError(f"Layout(placement): expected a gt.placement, got {type(placement).__name__}")
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "sbp", normalize_sbp(sbp, placement.ndim))
        _check_zigzag(self.sbp)
        _check_strided(self.sbp)
        object.__setattr__(self, "_hash", hash((placement, self.sbp)))
        # read on every wrap and in-place layout change: worked out once
        object.__setattr__(self, "_zigzag_axes", tuple(a for a, s in enumerate(self.sbp) if isinstance(s, Zigzag)))
        object.__setattr__(self, "_has_partial", any(isinstance(s, Partial) for s in self.sbp))
        object.__setattr__(self, "_strided_axes", tuple(a for a, s in enumerate(self.sbp) if isinstance(s, Strided)))

    # layouts key every cache (routes, dispatch decisions): hash once, compare identical objects at once
    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt on unpickling: hashes of str differ between processes
        return (Layout, (self.placement, self.sbp))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (isinstance(other, Layout) and self._hash == other._hash and self.sbp == other.sbp
                and self.placement == other.placement)

    def __repr__(self) -> str:
        return f"Layout({self.placement!r}, ({', '.join(map(repr, self.sbp))}))"

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, s in enumerate(self.sbp) if isinstance(s, Partial))

    @property
    def has_partial(self) -> bool:
        return self._has_partial

    @property
    def ragged_axes(self) -> tuple[int, ...]:
        return tuple(a for a, s in enumerate(self.sbp) if isinstance(s, Ragged))

    @property
    def zigzag_axes(self) -> tuple[int, ...]:
        return self._zigzag_axes

    @property
    def strided_axes(self) -> tuple[int, ...]:
        return self._strided_axes

    def strided_as_split(self) -> "Layout":
        """The same shards read as `Split`: the layout of the tensor with its strided dim in the order the
        ranks hold its rows (`sbp.strided_order`); the same local shapes only where every block divides
        evenly by its axis (`strided_even`)."""
        if not self.strided_axes:
            return self
        return Layout(self.placement, tuple(Split(s.dim) if isinstance(s, Strided) else s for s in self.sbp))

    def strided_even(self, shape: Sequence[int]) -> bool:
        """Whether every rank's strided piece is as long as its `Split` piece would be (each block divides
        by the axis size): then `strided_as_split` holds the same shards, of the permuted tensor."""
        return all(shape[s.dim] // s.groups % self.placement.shape[a] == 0
                   for a, s in enumerate(self.sbp) if isinstance(s, Strided))

    def strided_order(self, shape: Sequence[int]) -> list[int]:
        """The global rows of the strided dim in the order of the reading (`strided_as_split`)."""
        a = self.strided_axes[0]
        s = self.sbp[a]
        return strided_order(shape[s.dim], s.groups, self.placement.shape[a])

    def zigzag_as_split(self) -> "Layout":
        """The same shards read as `Split`: the layout of the tensor with its zigzag dim in zigzag order
        (`sbp.zigzag_order`). Boxing and the ring work on that reading; the rows' global places come
        from `ranges`."""
        if not self.zigzag_axes:
            return self
        return Layout(self.placement, tuple(Split(s.dim) if isinstance(s, Zigzag) else s for s in self.sbp))

    def ranges(self, shape: Sequence[int], rank: int) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """Per dim the (global start, size) ranges `rank` holds, in the order of its local rows: one per
        dim, two for a zigzag dim (chunks i and 2n-1-i of the piece earlier axes left it). None outside
        the placement."""
        coord = self.placement.coord(rank)
        if coord is None:
            return None
        box = _shard(self.zigzag_as_split().sbp, self.placement.shape, tuple(shape), coord)
        out = [((start, size),) for start, size in box]
        for axis, s in enumerate(self.sbp):
            if isinstance(s, Strided):  # no other axis cuts its dim (_check_strided): blocks of the whole dim
                out[s.dim] = strided_ranges(shape[s.dim], s.groups, self.placement.shape[axis], coord[axis])
        for axis, s in enumerate(self.sbp):
            if isinstance(s, Zigzag):  # the piece the earlier axes cut, then its two chunks
                start, size = _shard(self._without_zigzag, self.placement.shape, tuple(shape), coord)[s.dim]
                out[s.dim] = tuple((start + a, n) for a, n in
                                   zigzag_ranges(size, self.placement.shape[axis], coord[axis]))
        return tuple(out)

    @property
    def _without_zigzag(self) -> tuple:
        return tuple(Broadcast() if isinstance(s, Zigzag) else s for s in self.sbp)

    def zigzag_pieces(self, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The (start, size) pieces of the zigzag dim that the mesh axes before the zigzag axis cut (one
        piece, the whole dim, where none does), in order; each is zigzag-cut on its own."""
        a = self.zigzag_axes[0]
        d = self.sbp[a].dim
        p = self.placement
        return tuple(sorted({_shard(self._without_zigzag, p.shape, tuple(shape), p.coord(r))[d]
                             for r in p.flat_ranks}))

    def zigzag_order(self, shape: Sequence[int]) -> list[int]:
        """The global rows of the zigzag dim in the order of the zigzag reading (`zigzag_as_split`)."""
        a = self.zigzag_axes[0]
        return zigzag_order_of(self.zigzag_pieces(shape), self.placement.shape[a])

    def check_shape(self, shape: Sequence[int], arg: str = "sbp") -> None:
        for s in self.sbp:
            if isinstance(s, (Split, Ragged, Zigzag, Strided)) and s.dim >= len(shape):
                raise ValueError(f"{arg}: {s!r} splits dim {s.dim} but the tensor has {len(shape)} dims "
                                 f"(shape {tuple(shape)}); pick a dim below {len(shape)}")
            if isinstance(s, Strided) and shape[s.dim] % s.groups:
                raise ValueError(f"{arg}: {s!r} views dim {s.dim} of length {shape[s.dim]} as {s.groups} equal "
                                 f"blocks, which {shape[s.dim]} does not divide into; pick groups dividing it")

    def shard(self, shape: Sequence[int], rank: int) -> tuple[tuple[int, int], ...] | None:
        """Per dim (start, size) of the block `rank` holds, or None outside the placement."""
        if self.zigzag_axes:  # two ranges, not a box: a caller that reads a box would take the wrong rows
            raise TypeError(f"Layout.shard: {self.sbp} holds two ranges of its zigzag dim, not a box; use "
                            "Layout.ranges (or box the tensor to gt.split(d) first)")
        if self.strided_axes:
            raise TypeError(f"Layout.shard: {self.sbp} holds one range per block of its strided dim, not a box; "
                            "use Layout.ranges (or box the tensor to gt.split(d) first)")
        coord = self.placement.coord(rank)
        if coord is None:
            return None
        return _shard(self.sbp, self.placement.shape, tuple(shape), coord)

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        if self.zigzag_axes:
            return self.zigzag_as_split().local_shape(shape, rank)
        if self.strided_axes:
            ranges = self.ranges(shape, rank)
            return (0,) if ranges is None else tuple(sum(n for _, n in rs) for rs in ranges)
        box = self.shard(shape, rank)
        return (0,) if box is None else tuple(size for _, size in box)

    def local_shapes(self, shape: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Every rank's local shape, in `placement.flat_ranks` order (one pass: dispatch checks all ranks)."""
        return _local_shapes(self, tuple(shape))


@lru_cache(maxsize=65536)
def _shard(sbp: tuple[SBP, ...], mesh: tuple[int, ...], shape: tuple[int, ...],
           coord: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    box = [(0, n) for n in shape]
    for axis, s in enumerate(sbp):
        if isinstance(s, Split):
            start, size = box[s.dim]
            off, size = split_range(size, mesh[axis], coord[axis])
            box[s.dim] = (start + off, size)
    return tuple(box)


@lru_cache(maxsize=4096)
def _local_shapes(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    p = layout.placement
    if layout.strided_axes:
        return tuple(layout.local_shape(shape, r) for r in p.flat_ranks)
    cuts = [(axis, s.dim, p.shape[axis]) for axis, s in enumerate(layout.sbp) if isinstance(s, (Split, Zigzag))]
    if not cuts:
        return (shape,) * p.size
    shapes = []
    for r in p.flat_ranks:
        coord, sizes = p.coord(r), list(shape)
        for axis, d, parts in cuts:  # in mesh-axis order, as _shard cuts
            base, extra = divmod(sizes[d], parts)
            sizes[d] = base + (coord[axis] < extra)
        shapes.append(tuple(sizes))
    return tuple(shapes)


def _check_zigzag(sbp: tuple) -> None:
    """One dim at most is zigzag, and after its zigzag axis no axis cuts it: earlier axes may split it
    (mesh axis 0 cuts first: each of their pieces is zigzag-cut, one sequence per data rank when a
    batch and a sequence are flattened together), and the ring and boxing know one permutation."""
    zig = [(a, s) for a, s in enumerate(sbp) if isinstance(s, Zigzag)]
    if len(zig) > 1:
        raise ValueError(f"sbp: {sbp} has {len(zig)} zigzag axes; one mesh axis may be gt.zigzag(d) (the "
                         "others broadcast, split other dims or are partial)")
    for a, z in zig:
        for b, s in enumerate(sbp):
            if b != a and isinstance(s, (Split, Ragged)) and s.dim == z.dim and (b > a or isinstance(s, Ragged)):
                raise ValueError(f"sbp: {sbp} cuts dim {z.dim} on mesh axis {b} after its zigzag on mesh axis {a}; "
                                 f"a zigzag cuts the pieces earlier axes' splits leave, and no axis cuts its chunks "
                                 f"(split another dim on axis {b}, or split dim {z.dim} on an axis before {a})")


def _check_strided(sbp: tuple) -> None:
    """One mesh axis at most is strided, and no other axis cuts its dim: its pieces are ranges of blocks of
    the whole dim, which every reading of it (`ranges`, `strided_as_split`, boxing's unflattened view) assumes."""
    st = [(a, s) for a, s in enumerate(sbp) if isinstance(s, Strided)]
    if len(st) > 1:
        raise ValueError(f"sbp: {sbp} has {len(st)} strided axes; one mesh axis may be gt.strided(d, groups)")
    for a, z in st:
        for b, s in enumerate(sbp):
            if b != a and isinstance(s, (Split, Ragged, Zigzag)) and s.dim == z.dim:
                raise ValueError(f"sbp: {sbp} cuts dim {z.dim} on mesh axis {b} as well as strided on mesh axis {a}; "
                                 f"a strided split cuts the whole dim (split another dim on axis {b})")


def take_ranges(t, ranges: tuple[tuple[tuple[int, int], ...], ...]):
    """The rows of `t` (which holds every range) that `ranges` names, per dim in order (a copy where a dim
    has two ranges; a view otherwise)."""
    for d, rs in enumerate(ranges):
        if len(rs) == 1:
            if rs[0][1] != t.shape[d]:
                t = t.narrow(d, *rs[0])
        else:
            t = torch.cat([t.narrow(d, start, size) for start, size in rs], d)
    return t


def slice_box(t, box: tuple[tuple[int, int], ...]):
    """View of `t` restricted to `box` (a local slice: no copy, no communication)."""
    for d, (start, size) in enumerate(box):
        if size != t.shape[d]:
            t = t.narrow(d, start, size)
    return t


__all__ = ["Layout", "split_range", "split_sizes", "normalize_sbp", "slice_box", "take_ranges", "Broadcast"]
