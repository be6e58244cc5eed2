"""Moving a GlobalTensor to another device type: `x.to("cuda")`, `module.to(device)` (`_to_copy(device=)`).

The device type is part of the placement, so a move gives the same mesh and SBPs on a placement of the
new device type, each rank moving its own shard (nothing is communicated). A `device=` of the type the
placement already has is the cast rule's business (the shard stays on the rank's device).
"""
from __future__ import annotations

from typing import Any

import torch

from ..layout import Layout
from ..placement import DEVICE_TYPES, Placement
from .registry import Ctx


def device_changes(ctx: Ctx, srcs: tuple) -> bool:
    """Whether `_to_copy` asks for another device type than its input's placement has."""
    device = ctx.kwargs.get("device")
    return device is not None and torch.device(device).type != srcs[0].placement.device_type


def move_device(func: Any, args: tuple, kwargs: dict) -> Any:
    """Each rank's shard copied to the device asked for; the layout's placement takes its type."""
    x = args[0]
    p = x._layout.placement
    kind = torch.device(kwargs["device"]).type
    if kind not in DEVICE_TYPES:
        raise ValueError(f"to(device): a GlobalTensor's placement has one of the device types {DEVICE_TYPES}, "
                         f"got {kind!r}")
    moved = Placement(kind, p.shape, p.flat_ranks, p.topology)
    return type(x)(func(x._local, *args[1:], **kwargs), Layout(moved, x._layout.sbp), tuple(x.shape))
