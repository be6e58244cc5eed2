"""The fft family (`_fft_r2c`, `_fft_c2c`, `_fft_c2r`, which every `torch.fft` function lowers to).

An fft over the dims in its `dim` argument transforms each 1-D (n-D) line along them on its own: every
other dim is carried, so a split there passes and each rank transforms its own lines. A split of a
transformed dim cannot pass (every output frequency reads the whole line) and is gathered first. The
transforms are linear (real-linear for r2c and c2r), so a Partial input gives a Partial output; the
normalization scales by the transformed dims' sizes only, which every rank holds whole.

torch's CPU fft (MKL) raises on a tensor with no lines (an empty untouched dim), which an uneven split
gives a rank: the kernel returns that rank's empty output itself.
"""
from __future__ import annotations

from typing import Any

import torch

from .registry import P, Ctx, Rule, S, ShardSite, always, aten, register


def fft_signatures(ctx: Ctx) -> list:
    n = len(ctx.shapes[0])
    transformed = {d % n for d in ctx.arg(1, "dim")}
    return [((S(d),), (S(d),)) for d in range(n) if d not in transformed] + [((P,), (P,))]


def fft_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The transform of this rank's lines; none (an empty shard): the empty output, shaped as torch's meta says."""
    x = args[0]
    if x.numel() or x.device.type == "meta":
        return func(*args, **kwargs)
    out = func(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args[1:], **kwargs)
    return torch.empty(out.shape, dtype=out.dtype, device=x.device)


register([aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default],
         Rule(fft_signatures, kernel=fft_local, plain_when=always))

__all__ = ["fft_signatures", "fft_local"]
