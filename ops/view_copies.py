"""The `*_copy` ops (view_copy, permute_copy, squeeze_copy, ...) and unsafe_split: their view twin's rule.

A `*_copy` op computes what its view twin computes, into fresh memory, so a split travels along it as
along the view (`ops/view.py`). Only the shard's memory differs: a kernel that reshapes a shard must hand
back a copy where the reshape gave a view, or a later in-place write to the result would reach the input.
unsafe_split is split without autograd's view tracking: the same shards.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..runtime.graph_ops import traced
from .registry import Ctx, ShardSite, aten, register
from .view import (RESHAPE, dim_map_rule, expand_map, keep_others, reshape_local, transpose_map)


def _fresh(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`out`, copied where it shares memory with `source`."""
    if out.is_meta:
        return out
    if traced(out):  # torch.compile is tracing: no storage to compare, so always the copy (never an alias)
        return out.clone(memory_format=torch.contiguous_format)
    if out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
        return out
    return out.clone(memory_format=torch.contiguous_format)


def reshape_copy(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> torch.Tensor:
    """The reshape kernel (sizes restated for the shard), into fresh memory."""
    return _fresh(reshape_local(func, args, kwargs, where), args[0])


register([aten.view_copy.default, aten.squeeze_copy.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims,
          aten.unsqueeze_copy.default, aten._reshape_copy.default],
         dataclasses.replace(RESHAPE, kernel=reshape_copy, decompose=None, decompose_when=None))

_PERMUTE_TWINS = {aten.t_copy.default: aten.t.default, aten.permute_copy.default: aten.permute.default,
                  aten.transpose_copy.int: aten.transpose.int}


def _permuted(ctx: Ctx) -> dict:
    """The dim map of the view twin (`transpose_map` reads which of t, permute, transpose it is)."""
    return transpose_map(dataclasses.replace(ctx, func=_PERMUTE_TWINS[ctx.func]))


register(list(_PERMUTE_TWINS), dim_map_rule(_permuted))
register([aten.alias_copy.default], dim_map_rule(lambda c: {d: d for d in range(len(c.shapes[0]))}))
register([aten.expand_copy.default],
         dim_map_rule(expand_map, lambda f, a, k, w: aten.expand_copy.default(a[0], list(w.out_shape(0)))))
register([aten.narrow_copy.default, aten.split_with_sizes_copy.default, aten.unsafe_split.Tensor,
          aten.unsafe_split_with_sizes.default], dim_map_rule(keep_others()))
register([aten.unbind_copy.int], dim_map_rule(keep_others(drop=True)))
