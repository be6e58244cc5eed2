"""Box arithmetic: a box is a per-dim (start, size) tuple, as `Layout.shard` returns."""
from __future__ import annotations

import math

import torch

Box = tuple[tuple[int, int], ...]


def numel(box: Box) -> int:
    return math.prod(size for _, size in box)


def sizes(box: Box) -> tuple[int, ...]:
    return tuple(size for _, size in box)


def intersect(a: Box, b: Box) -> Box:
    """The overlap of two boxes (sizes clamp at zero)."""
    out = []
    for (s1, n1), (s2, n2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + n1, s2 + n2)
        out.append((lo, max(hi - lo, 0)))
    return tuple(out)


def relative(box: Box, origin: Box) -> Box:
    """`box` in the coordinates of a local tensor that holds `origin`."""
    return tuple((s - o, n) for (s, n), (o, _) in zip(box, origin))


def identity(op: str, dtype: torch.dtype):
    """The value x with op(x, y) == y: what a rank holds where it contributes nothing to a Partial."""
    if op == "sum":
        return 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point or dtype.is_complex:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max
