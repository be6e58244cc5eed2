"""Converting a single-device nn.Module: parameters and buffers become GlobalTensors in place.

`plan` maps parameter/buffer name patterns (fnmatch globs, e.g. "*.mlp.fc.weight")
to nd-SBPs; the first matching pattern wins and anything unmatched is
Broadcast. A tensor reachable under several names (tied weights) is converted
once, under its first name, and stays one Parameter.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Optional

import torch

from .layout import normalize_sbp
from .placement import Placement
from .sbp import Broadcast


def _sbp_for(name: str, plan: Optional[Mapping[str, Any]], placement: Placement) -> tuple:
    for pattern, sbp in (plan or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return normalize_sbp(sbp, placement.ndim, f"to_global(plan[{pattern!r}])")
    return (Broadcast(),) * placement.ndim


def module_to_global(module: torch.nn.Module, placement: Placement,
                     plan: Optional[Mapping[str, Any]] = None) -> torch.nn.Module:
    """Convert `module` in place (and return it); values are unchanged, gradients arrive as GlobalTensors."""
    from .api import to_global
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"to_global(plan): expected a dict {{name pattern: sbp}}, got {type(plan).__name__}")
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    unused = [p for p in (plan or {}) if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unused:
        raise ValueError(f"to_global(plan): patterns {unused} match no parameter or buffer; names look like "
                         f"{sorted(names)[:4]}")
    done: dict[int, torch.Tensor] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(mod, kind)
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in done:
                    full = f"{prefix}.{name}" if prefix else name
                    g = to_global(t.detach(), placement, _sbp_for(full, plan, placement))
                    done[id(t)] = torch.nn.Parameter(g, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else g
                table[name] = done[id(t)]
    return module
