"""Halo exchange: a sliding-window op over a split dim, each rank computing its block of outputs.

Output row t of a convolution along a dim reads input rows t*stride - pad + j*dilation (j < kernel):
a block of outputs reads a window of input rows a little wider than the block the rank holds. The
rows beyond its own (the halo) come from the ranks that hold them, point to point, so a split
sequence stays split through the causal 1-D convolutions of Mamba-style and audio models, where
gathering it would move the whole sequence to every rank. Rows outside the input (the op's zero
padding) are zeros in the window, which the op then runs on with no padding along that dim.

The backward runs the op's backward on the same window (exchanged again: what autograd saved is the
rank's own block), and sends the window's gradient rows that belong to other ranks back to them,
where they are added: the exchange reversed. `halo_cost` bills both as `Rule.kernel_cost` does the
ring's: the bytes each rank receives, and as latency the most peers a rank hears from or tells.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from ..layout import Layout
from ..runtime import context
from ..runtime.symmetry import rank_specific
from .moves import peers


@dataclass(frozen=True)
class Window:
    """How an output row reads its input along `dim`: rows t*stride - pad .. t*stride - pad + reach."""
    dim: int
    stride: int
    pad: int
    reach: int  # dilation * (kernel - 1): how far past its first row a window reads

    def rows(self, out_start: int, out_size: int) -> tuple[int, int]:
        """(first, count) of the input rows that outputs [out_start, out_start + out_size) read, in global
        coordinates: below 0 or past the input's end are the padding's zeros. No outputs read nothing."""
        first = out_start * self.stride - self.pad
        return first, (out_size - 1) * self.stride + self.reach + 1 if out_size else 0


@lru_cache(maxsize=4096)
def halo_piece(layout: Layout, in_shape: tuple, out_layout: Layout, out_shape: tuple, win: Window,
               src: int, dst: int) -> Optional[tuple[int, int, int]]:
    """The rows of `src`'s input block that `dst`'s window reads: (start in src's block, start in dst's
    window, count), or None."""
    s0, sn = layout.shard(in_shape, src)[win.dim]
    lo, wn = win.rows(*out_layout.shard(out_shape, dst)[win.dim])
    a, b = max(s0, lo), min(s0 + sn, lo + wn)
    return (a - s0, a - lo, b - a) if b > a else None


_FORWARD, _BACK = zlib.crc32(b"halo"), zlib.crc32(b"halo back")  # message keys, the same in every process


def _resized(shape: torch.Size, dim: int, size: int) -> tuple[int, ...]:
    return tuple(shape[:dim]) + (size,) + tuple(shape[dim + 1:])


def gather_window(x: torch.Tensor, layout: Layout, in_shape: tuple, out_layout: Layout, out_shape: tuple,
                  win: Window, rank: int, checking: bool = False) -> torch.Tensor:
    """The input rows this rank's outputs read along `win.dim` (zeros where they fall in the padding):
    its own copied, the rest received from their holders, while it sends its rows to the peers whose
    windows read them. `checking` (meta shards): the window's shape, nothing exchanged."""
    out_start, out_size = out_layout.shard(out_shape, rank)[win.dim]
    window = x.new_zeros(_resized(x.shape, win.dim, win.rows(out_start, out_size)[1]))
    if checking:
        return window
    rank_specific("a halo exchange (edge ranks have one neighbour)")
    sends, recvs = {}, {}
    for q in peers(layout, {win.dim}, rank):
        give = halo_piece(layout, in_shape, out_layout, out_shape, win, rank, q)
        take = halo_piece(layout, in_shape, out_layout, out_shape, win, q, rank)
        if q == rank:
            if give:
                window.narrow(win.dim, give[1], give[2]).copy_(x.narrow(win.dim, give[0], give[2]))
            continue
        if give:
            sends[q] = x.narrow(win.dim, give[0], give[2])
        if take:
            recvs[q] = (_resized(x.shape, win.dim, take[2]), x.dtype)
    if sends or recvs:
        got = context.current().exchange(sends, recvs, device=x.device, key=_FORWARD)
        for q, rows in got.items():
            at = halo_piece(layout, in_shape, out_layout, out_shape, win, q, rank)
            window.narrow(win.dim, at[1], at[2]).copy_(rows)
    return window


def return_window(grad_window: torch.Tensor, x_shape: torch.Size, layout: Layout, in_shape: tuple,
                  out_layout: Layout, out_shape: tuple, win: Window, rank: int,
                  checking: bool = False) -> torch.Tensor:
    """The gradient of this rank's input block from every window that read it: the rows of its own
    window's gradient that are its own, plus the rows the peers' windows read, sent back by them."""
    grad = grad_window.new_zeros(x_shape)
    if checking:
        return grad
    rank_specific("a halo exchange (edge ranks have one neighbour)")
    sends, recvs = {}, {}
    for q in peers(layout, {win.dim}, rank):
        mine = halo_piece(layout, in_shape, out_layout, out_shape, win, rank, q)  # my rows q's window read
        theirs = halo_piece(layout, in_shape, out_layout, out_shape, win, q, rank)  # q's rows my window read
        if q == rank:
            if mine:
                grad.narrow(win.dim, mine[0], mine[2]).add_(grad_window.narrow(win.dim, mine[1], mine[2]))
            continue
        if theirs:
            sends[q] = grad_window.narrow(win.dim, theirs[1], theirs[2])
        if mine:
            recvs[q] = (_resized(x_shape, win.dim, mine[2]), grad_window.dtype)
    if sends or recvs:
        got = context.current().exchange(sends, recvs, device=grad_window.device, key=_BACK)
        for q in sorted(got):  # a fixed order of additions: every rank's sum the same on every run
            at = halo_piece(layout, in_shape, out_layout, out_shape, win, rank, q)
            grad.narrow(win.dim, at[0], at[2]).add_(got[q])
    return grad


def halo_cost(layout: Layout, in_shape: tuple, out_layout: Layout, out_shape: tuple, win: Window,
              itemsize: int, backward: bool) -> tuple:
    """What the exchange receives per global rank (the backward: the window again and the gradient rows
    sent back), and its latency term: the most peers a rank receives from or sends to."""
    ranks = layout.placement.flat_ranks
    recv, hears, tells = [0] * (max(ranks) + 1), dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
    for r in ranks:
        row = math.prod(s for d, s in enumerate(layout.local_shape(in_shape, r)) if d != win.dim)
        for q in peers(layout, {win.dim}, r):
            if q == r:
                continue
            taken = halo_piece(layout, in_shape, out_layout, out_shape, win, q, r)
            given = halo_piece(layout, in_shape, out_layout, out_shape, win, r, q)
            rows = (taken[2] if taken else 0) + (given[2] if given and backward else 0)
            if rows:
                recv[r] += rows * row * itemsize
            if taken or (given and backward):
                hears[r] += 1
                tells[q] += 1
    if not any(recv):
        return (), 0
    return tuple(recv), max(max(hears.values()), max(tells.values()))
