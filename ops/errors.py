"""Telling a user's error from a shape only the values can tell, when an op's meta kernel fails.

A decision first runs the op on meta tensors of the global shapes. When that fails because the output
shape depends on the values (`nonzero`, `x[mask]`, `.item()`), the op runs replicated or decomposes. When
it fails for any other reason, the call itself is wrong (`a @ a` with mismatched shapes): the error is
the kernel's own, raised at once and naming the op and its inputs' global shapes and layouts, before any
input is moved and never as a "no SBP rule" fallback warning first.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..runtime.failure import CollectiveError, RankError

_DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")


def data_dependent(e: BaseException) -> bool:
    """Whether a meta kernel's failure says "no meta kernel / the values decide" rather than "bad call"."""
    if isinstance(e, NotImplementedError) or type(e).__name__ in _DATA_DEPENDENT:
        return True
    text = str(e).lower()
    return "meta" in text or "data-dependent" in text or "data dependent" in text


def describe(tensors: Sequence[Any], cls: type) -> str:
    """The inputs as a user sees them: global shape, dtype and SBP (plain tensors count as Broadcast)."""
    parts = []
    for i, t in enumerate(tensors):
        sbp = t._layout.sbp if isinstance(t, cls) else "plain tensor (Broadcast)"
        parts.append(f"#{i} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {sbp}")
    placement = next((t._layout.placement for t in tensors if isinstance(t, cls)), None)
    return "; ".join(parts) + (f" on {placement}" if placement is not None else "")


def kernel_error(func: Any, e: BaseException, tensors: Sequence[Any], cls: type,
                 rank: Optional[int] = None) -> BaseException:
    """The kernel's exception, of its type, with the op and the inputs' layouts prefixed (and the rank,
    for an error the kernel raised on one rank's shards)."""
    if isinstance(e, (CollectiveError, RankError)):  # about communication, not the kernel: as raised
        return e
    said = str(e)
    where = "" if rank is None else f"on rank {rank}'s shards; "
    head = said if said.startswith(str(func)) else f"{func}: {said}"
    text = f"{head} [{where}GlobalTensor inputs: {describe(tensors, cls)}]"
    try:
        return type(e)(text)
    except Exception:  # an exception type with another constructor
        return RuntimeError(text)
