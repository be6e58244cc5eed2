"""Telling a mismatched collective from a slow one on real processes, within seconds.

The simulator sees every rank's call and names a mismatch at once; gloo just waits out its timeout
(300 s) for a partner that never comes, then says "Timed out waiting for send operation". Here each
rank notes, at no more cost than a tuple, which collective it is in: kind, group, its sequence number
on that group, sizes. Only when one has waited `GT_STALL_CHECK` seconds (default 1) does a watcher
thread post it to the job's store and read its peers' posts:

- a peer waiting in another collective of a group that includes this rank (another kind, another
  call number on the group, other sizes), or a peer done with the program: a mismatch. Both calls are
  named and the rank fails (under `gt.launch` as its error; under torchrun on stderr, exit code 1),
  as it cannot return from a wait inside gloo;
- a peer in the same collective, computing, or waiting on ranks this one is not part of: only slow,
  and the wait goes on (the timeout still ends a true hang).

The same post is read twice, a poll apart, before a rank fails: a peer that just left a stalled
collective has had time to say so. Checked on gloo (on by default: `GT_CHECK_COLLECTIVES=0` turns it
off); nccl's collectives return before they complete, so a stall is not seen there.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from .failure import CollectiveError

_PREFIX = "gt/watch/"


def enabled() -> bool:
    return os.environ.get("GT_CHECK_COLLECTIVES", "1") not in ("0", "")


def stall_seconds() -> float:
    return float(os.environ.get("GT_STALL_CHECK", "1"))


_FORMATS = {"all_reduce": "{0} x {1}, {2}", "reduce_scatter": "{0} x {1} in all, {2}",
            "all_gather": "{0} x {1} per rank", "broadcast": "{0} {1} from rank {2}", "all_to_all": "{1}"}


def sizes(kind: str, what: Any) -> str:
    """A call's sizes as text (formatted only when posted: the caller hands over a tuple)."""
    if isinstance(what, str):
        return what
    parts = [str(x).replace("torch.", "") for x in what]
    try:
        return _FORMATS[kind].format(*parts)
    except (KeyError, IndexError):
        return ", ".join(parts)


def describe(call: Sequence) -> str:
    """A posted call as a user reads it: `all_reduce #3 on group (0, 1) [4 x float32]`."""
    state, kind, group, seq, what = call
    if state == "finished":
        return f"returned from the program (collectives made: {what})"
    return f"{kind} #{seq} on group {tuple(group)} [{what}]"


class CollectiveWatch:
    """This rank's current collective, and the thread that compares it with its peers' when it stalls."""

    def __init__(self, store: Any, rank: int, fail: Callable[[CollectiveError], None],
                 stall: Optional[float] = None, poll: float = 0.25) -> None:
        self._store, self.rank, self._fail = store, rank, fail
        self._stall = stall_seconds() if stall is None else stall
        self._poll = poll
        self._seq: dict[tuple, int] = {}
        self._current: Optional[tuple] = None  # (kind, group, seq, what, since)
        self._posted: Optional[list] = None
        self._suspect: Optional[tuple] = None
        self._stop = False
        threading.Thread(target=self._loop, name="gt-collective-watch", daemon=True).start()

    # -- the caller's side: two assignments per collective ------------------------------------------
    def enter(self, kind: str, group: Sequence[int], what: str) -> None:
        key = tuple(sorted(group))
        seq = self._seq[key] = self._seq.get(key, 0) + 1
        self._current = (kind, key, seq, what, time.monotonic())

    def leave(self) -> None:
        self._current = None
        if self._posted is not None:  # it had stalled and said so: peers must not read a stale post
            self._posted = None
            self._store.set(_PREFIX + str(self.rank), json.dumps(["running", "", [], 0, ""]))

    def finish(self) -> None:
        """The program returned: a peer still waiting for this rank is told it never will."""
        counts = ", ".join(f"{n} on group {g}" for g, n in sorted(self._seq.items())) or "none"
        self._stop = True
        try:
            self._store.set(_PREFIX + str(self.rank), json.dumps(["finished", "", [], 0, counts]))
        except Exception:  # noqa: BLE001 - at exit the job's store may be gone already: nothing to tell
            pass

    def explain(self) -> str:
        """Why the current collective failed, where peers said (gloo fails it when a peer's process ends)."""
        cur = self._current
        if cur is None:
            return ""
        kind, group, seq, what, _ = cur
        mine = ["waiting", kind, list(group), seq, sizes(kind, what)]
        notes = []
        for peer in group:
            if peer != self.rank and self._store.check([_PREFIX + str(peer)]):
                theirs = json.loads(self._store.get(_PREFIX + str(peer)))
                if self._blocks(mine, theirs):
                    verb = "" if theirs[0] == "finished" else "waits in "
                    notes.append(f"rank {peer} {verb}{describe(theirs)}")
        return f"rank {self.rank} was in {describe(mine)} while " + "; ".join(notes) if notes else ""

    # -- the watcher ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            time.sleep(self._poll)
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the store went away (the job is ending): stop watching
                return

    def _check(self) -> None:
        cur = self._current
        if cur is None or time.monotonic() - cur[4] < self._stall:
            self._suspect = None
            return
        kind, group, seq, what, _ = cur
        mine = ["waiting", kind, list(group), seq, sizes(kind, what)]
        if self._posted != mine:
            self._store.set(_PREFIX + str(self.rank), json.dumps(mine))
            self._posted = mine
        for peer in group:
            if peer == self.rank or not self._store.check([_PREFIX + str(peer)]):
                continue
            theirs = json.loads(self._store.get(_PREFIX + str(peer)))
            if not self._blocks(mine, theirs):
                continue
            if self._suspect == (peer, theirs, mine) and self._current is cur:
                self._fail(CollectiveError(
                    f"collective mismatch: rank {self.rank} waits in {describe(mine)} while rank {peer} "
                    f"{describe(theirs) if theirs[0] == 'finished' else 'waits in ' + describe(theirs)}"
                    f" (noticed after {self._stall:g} s of waiting; GT_STALL_CHECK sets it)"))
                return
            self._suspect = (peer, theirs, mine)
            return

    def _blocks(self, mine: list, theirs: list) -> bool:
        """Whether a peer's post means it will never join this rank's collective."""
        if theirs[0] == "finished":
            return True
        if theirs[0] != "waiting" or theirs[1:] == mine[1:]:
            return False
        return self.rank in theirs[2]  # it waits for this rank elsewhere: neither can go on


def exit_with(err: CollectiveError) -> None:
    """Under torchrun: the main thread is inside gloo's wait, so the process ends, saying why."""
    print(f"globaltensor: {err}", file=sys.stderr, flush=True)
    os._exit(1)
