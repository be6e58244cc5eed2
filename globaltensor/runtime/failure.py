"""How ranks fail: the collective timeout, the two errors, and re-raising the root failure.

The bottom of `runtime/`: the communicator, both backends and `launch` use these,
and this file uses none of them.
"""
from __future__ import annotations

import os


def default_timeout() -> float:
    """Seconds a collective may wait for its peers (`GT_TIMEOUT`, default 300)."""
    return float(os.environ.get("GT_TIMEOUT", "300"))


class CollectiveError(RuntimeError):
    """A collective that could not complete: mismatch, missing rank, timeout or abort."""


class RankError(RuntimeError):
    """A rank failed and its exception could not be carried back as itself."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def raise_rank_failure(errors: dict[int, tuple[BaseException, str]]) -> None:
    """Re-raise the root failure: the lowest rank whose error was not a consequence of another's."""
    primary = [r for r, (e, _) in errors.items() if not isinstance(e, CollectiveError)]
    rank = min(primary) if primary else min(errors)
    exc, tb = errors[rank]
    # an exception from another process lost its frames in pickling: carry them in the note
    note = f"raised on rank {rank}" + ("" if exc.__traceback__ or not tb else f"; its traceback:\n{tb}")
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc = RankError(rank, f"rank {rank} failed: {exc!r}\n{note}")
    exc.rank = rank
    raise exc
