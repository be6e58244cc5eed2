"""What the dispatcher counts, per op: so a user sees which ops ran replicated and which ones boxed."""
from __future__ import annotations

import sys
import warnings
from collections import Counter

STATS: dict[str, Counter] = {"fallback": Counter(), "boxed": Counter(), "decisions": Counter()}
_WARNED: set = set()


def stats() -> dict[str, dict[str, int]]:
    """Counts per op: `fallback` (ran replicated for lack of a rule), `boxed` (calls whose inputs needed
    boxing), `decisions` (cache misses that chose a signature)."""
    return {k: dict(v) for k, v in STATS.items()}


def reset_stats() -> None:
    """Zero the counts `stats()` reports, e.g. between a warm-up step and the step to inspect."""
    for c in STATS.values():
        c.clear()


def note_fallback(name: str) -> None:
    """Count a replicated run; warn once per op, pointing at the user's code rather than ours."""
    STATS["fallback"][name] += 1
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"globaltensor: no SBP rule for {name}; its inputs are gathered to Broadcast and it runs "
                      "replicated (counted in gt.stats()['fallback'])", stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside globaltensor and torch (warnings name the user's line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("globaltensor", "torch")):
            return level
        frame, level = frame.f_back, level + 1
    return 2
