"""An op's arguments by their schema names, for decompositions and rules that read several of them."""
from __future__ import annotations

from typing import Any


def named_args(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """{argument name: value} over the op's whole schema: given positionally, by keyword, or defaulted.

    Overloads place the same argument differently (`var.dim(self, dim, unbiased, keepdim)`,
    `var.correction(self, dim, *, correction, keepdim)`), so reading by position misreads one of them.
    """
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        else:
            out[a.name] = kwargs.get(a.name, a.default_value)
    return out


def reduced_dims(named: dict[str, Any], nd: int) -> list[int]:
    """The dims a reduction's `dim` argument names, sorted and non-negative (None or [] is every dim)."""
    dim = named.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(nd))
    return sorted({d % max(nd, 1) for d in ([dim] if isinstance(dim, int) else dim)})
