"""Packing an all-to-all: a shard's pieces, one per group member, to and from one flat buffer.

A collective moves flat segments in group order. Boxing's pieces are slices of
a shard along one dim, in order, so the packing is usually cheaper than a copy
per piece: none when the pieces already lie back to back in memory (slices
along the outermost dim), one strided copy when they are equal (the shard seen
as [n, piece] with the cut dim moved to the front). Only uneven slices along
an inner dim take a copy each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..layout import slice_box
from .boxes import Box, numel, sizes


@dataclass(frozen=True)
class Tiling:
    """`boxes` (one per member, group order) tiling a shard of `shape`: how to pack them flat."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    splits: tuple[int, ...]  # elements per box: the collective's segment sizes
    kind: str  # "flat": the shard is the buffer | "even": one strided copy | "pieces": a copy per box
    dim: int = 0  # the cut dim, for "even"

    @classmethod
    def of(cls, shape: Sequence[int], boxes: Sequence[Box]) -> "Tiling":
        shape, boxes = tuple(shape), tuple(boxes)
        splits = tuple(numel(b) for b in boxes)
        cut = [d for d in range(len(shape)) if any(b[d] != (0, shape[d]) for b in boxes)]
        dim = cut[0] if cut else 0
        if not shape or len(cut) > 1 or not _in_order(boxes, shape, dim):
            return cls(shape, boxes, splits, "pieces")
        if math.prod(shape[:dim]) == 1 or len(boxes) == 1:
            return cls(shape, boxes, splits, "flat", dim)
        if len(set(b[dim][1] for b in boxes)) == 1:
            return cls(shape, boxes, splits, "even", dim)
        return cls(shape, boxes, splits, "pieces")

    def _stacked(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (of `shape`) as [members, *piece shape]: piece j at index j, no copy."""
        n = len(self.boxes)
        return t.unflatten(self.dim, (n, self.shape[self.dim] // n)).movedim(self.dim, 0)

    def packer(self) -> Callable[[torch.Tensor, Callable], torch.Tensor]:
        """(shard, buffer) -> the flat send buffer, where `buffer(numel, dtype)` lends a scratch
        buffer (`Communicator.send_buffer`), asked for only when a copy is needed."""
        total = sum(self.splits)
        if self.kind == "flat":
            def pack_flat(t, buffer):
                return t.view(-1) if t.is_contiguous() else buffer(total, t.dtype).view(self.shape).copy_(t).view(-1)
            return pack_flat
        if self.kind == "even":
            piece = (len(self.boxes),) + sizes(self.boxes[0])

            def pack_even(t, buffer):
                buf = buffer(total, t.dtype)
                buf.view(piece).copy_(self._stacked(t))
                return buf
            return pack_even
        segments = self._segments()

        def pack_pieces(t, buffer):
            buf = buffer(total, t.dtype)
            for box, (start, n) in zip(self.boxes, segments):
                buf[start:start + n].view(sizes(box)).copy_(slice_box(t, box))
            return buf
        return pack_pieces

    def unpacker(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """flat received buffer -> the shard; None when the buffer, viewed as `shape`, already is it."""
        if self.kind == "flat":
            return None
        if self.kind == "even":
            piece = (len(self.boxes),) + sizes(self.boxes[0])

            def unpack_even(flat):
                out = flat.new_empty(self.shape)
                self._stacked(out).copy_(flat.view(piece))
                return out
            return unpack_even
        segments = self._segments()

        def unpack_pieces(flat):
            out = flat.new_empty(self.shape)
            for box, (start, n) in zip(self.boxes, segments):
                slice_box(out, box).copy_(flat[start:start + n].view(sizes(box)))
            return out
        return unpack_pieces

    def _segments(self) -> list[tuple[int, int]]:
        starts = [0]
        for n in self.splits[:-1]:
            starts.append(starts[-1] + n)
        return list(zip(starts, self.splits))


def _in_order(boxes: tuple[Box, ...], shape: tuple[int, ...], dim: int) -> bool:
    """The boxes cut `dim` into consecutive ranges, in order, covering it (empty ones included)."""
    end = 0
    for b in boxes:
        start, size = b[dim]
        if size > 0:
            if start != end:
                return False
            end = start + size
    return end == shape[dim]
