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

A hang is a wait of `GT_HANG_SECONDS` (default 30; 0: never) on peers that never joined and are not waiting
themselves (computing, stuck, on another node that stopped; a peer waiting elsewhere is held up by someone
its own watcher names): the rank fails naming them, instead of waiting out gloo's timeout. Before it
does, it raises the job's alarm in the store, and every rank's watcher, the hung ones' included (a watcher
is a thread of its own), writes its flight record, its last collectives with their groups, call numbers,
sizes and times and what it is doing now (`doing_now`: its stack's innermost program line, module forward
and dispatched op), to `GT_HANG_REPORT_DIR` (default the working directory) as `gt-flight-rank<r>.json`, and
posts its last one: the error names each missing rank's last collective and where the records are, as torch's flight
recorder does for nccl.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from .failure import CollectiveError

_PREFIX = "gt/watch/"


def enabled() -> bool:
    return os.environ.get("GT_CHECK_COLLECTIVES", "1") not in ("0", "")


def stall_seconds() -> float:
    return float(os.environ.get("GT_STALL_CHECK", "1"))


def doing_now(thread: int) -> dict:
    """What `thread` is doing, from its stack: the innermost op being dispatched, the innermost module whose
    forward runs, and the innermost line of the program's own code (not globaltensor's, not torch's). Read only
    when a hang is reported, so the collectives pay nothing for it."""
    frame = sys._current_frames().get(thread)
    ours = tuple(os.path.dirname(m.__file__) + os.sep
                 for name in ("globaltensor", "globaltensor.ops", "globaltensor.boxing")
                 if (m := sys.modules.get(name)) is not None and getattr(m, "__file__", None))
    torch_mod = sys.modules.get("torch")
    skip = ours + ((os.path.dirname(torch_mod.__file__) + os.sep,) if torch_mod is not None else ())
    out: dict = {"op": None, "module": None, "at": None}
    while frame is not None:
        code = frame.f_code
        if out["op"] is None and code.co_name == "__torch_dispatch__" and "func" in frame.f_locals:
            out["op"] = str(frame.f_locals["func"])
        if out["module"] is None and code.co_name == "forward":
            owner = frame.f_locals.get("self")
            if owner is not None and hasattr(owner, "_modules"):  # an nn.Module's forward
                out["module"] = type(owner).__name__
        if out["at"] is None and not code.co_filename.startswith(skip) and "/threading.py" not in code.co_filename:
            out["at"] = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return out


def hang_seconds() -> float:
    return float(os.environ.get("GT_HANG_SECONDS", "30"))


def flight_path(rank: int) -> str:
    return os.path.join(os.environ.get("GT_HANG_REPORT_DIR") or os.getcwd(), f"gt-flight-rank{rank}.json")


_ALARM = _PREFIX + "alarm"
RECENT = 16  # collectives a flight record keeps


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
        self._hang = hang_seconds()
        self._recent: deque = deque(maxlen=RECENT)  # [kind, group, seq, what, started, ended or None]
        self._recorded = False
        self._owner = threading.get_ident()  # the thread whose collectives these are: what it is doing, on a hang
        self._thread = threading.Thread(target=self._loop, name="gt-collective-watch", daemon=True)
        self._thread.start()

    # -- the caller's side: two assignments per collective ------------------------------------------
    def enter(self, kind: str, group: Sequence[int], what: str) -> None:
        key = tuple(sorted(group))
        seq = self._seq[key] = self._seq.get(key, 0) + 1
        self._current = (kind, key, seq, what, time.monotonic())
        self._recent.append([kind, key, seq, what, self._current[4], None])

    def leave(self) -> None:
        self._current = None
        if self._recent:
            self._recent[-1][5] = time.monotonic()
        if self._posted is not None:  # it had stalled and said so: peers must not read a stale post
            self._posted = None
            self._store.set(_PREFIX + str(self.rank), json.dumps(["running", "", [], 0, ""]))

    def finish(self) -> None:
        """The program returned: a peer still waiting for this rank is told it never will."""
        counts = ", ".join(f"{n} on group {g}" for g, n in sorted(self._seq.items())) or "none"
        self._stop = True
        if self._thread is not threading.current_thread():
            # no store call of the watcher may outlive this: the process group (and its store) is destroyed next
            # at exit, and a client torn down under another thread's call aborts the process
            self._thread.join(timeout=2 * self._poll + 5)
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
        polls = 0
        while not self._stop:
            time.sleep(self._poll)
            polls += 1
            try:
                if not self._recorded and polls % 4 == 0 and self._store.check([_ALARM]):
                    self._record()  # a peer found a hang: say what this rank was doing, whatever it is doing
                self._check()
            except Exception:  # noqa: BLE001 - the store went away (the job is ending): stop watching
                return

    def _last(self) -> str:
        """This rank's last collective, as a user reads it, and whether it is still in it."""
        if not self._recent:
            return "no collective yet"
        kind, group, seq, what, started, ended = self._recent[-1]
        state = "still waiting in" if ended is None else f"{time.monotonic() - ended:.0f} s since it left"
        return f"{state} {kind} #{seq} on group {group} [{sizes(kind, what)}]"

    def _record(self) -> str:
        """Write this rank's flight record, post its last collective; the record's path."""
        self._recorded = True
        now = time.monotonic()
        calls = [{"kind": k, "group": list(g), "call": seq, "sizes": sizes(k, w), "started_s_ago": round(now - t0, 3),
                  "took_s": None if t1 is None else round(t1 - t0, 3)} for k, g, seq, w, t0, t1 in self._recent]
        path = flight_path(self.rank)
        doing = doing_now(self._owner)
        try:
            with open(path, "w") as f:
                json.dump({"rank": self.rank, "pid": os.getpid(), "last": self._last(), "doing": doing,
                           "recent": calls}, f, indent=1)
        except OSError as e:
            path = f"(not written: {e})"
        now = "; ".join(f"{label} {doing[k]}" for k, label in (("at", "now at"), ("module", "in a forward of"),
                                                                 ("op", "dispatching")) if doing[k])
        self._store.set(_PREFIX + "last/" + str(self.rank), self._last() + (f"; {now}" if now else ""))
        return path

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
        waited = time.monotonic() - cur[4]
        if self._hang and waited >= self._hang and self._current is cur:
            # the missing ranks that are not waiting themselves: one that waits in another collective (of a group
            # without this rank) is held up by someone else, whom its own watcher names
            missing = [p for p in group if p != self.rank and self._post(p)[:1] != ["waiting"]]
            if missing:
                self._report_hang(mine, missing, waited)
                return
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

    def _post(self, peer: int) -> list:
        """What a peer last posted (it posts only once it has waited `GT_STALL_CHECK`): [] where nothing."""
        if not self._store.check([_PREFIX + str(peer)]):
            return []
        return json.loads(self._store.get(_PREFIX + str(peer)))

    def _report_hang(self, mine: list, missing: list, waited: float) -> None:
        """Raise the alarm, give the peers' watchers a moment to record and post, then fail naming who is missing
        and what each missing rank did last."""
        self._store.set(_ALARM, json.dumps([self.rank, describe(mine)]))
        path = self._record()
        lasts = {}
        deadline = time.monotonic() + 4 * self._poll * 4
        while time.monotonic() < deadline and len(lasts) < len(missing):
            for p in missing:
                if p not in lasts and self._store.check([_PREFIX + "last/" + str(p)]):
                    lasts[p] = self._store.get(_PREFIX + "last/" + str(p)).decode()
            time.sleep(self._poll)
        told = "; ".join(f"rank {p}: {lasts.get(p, 'no answer (its process may be gone or frozen)')}" for p in missing)
        self._fail(CollectiveError(
            f"hang: rank {self.rank} has waited {waited:.0f} s in {describe(mine)}, which rank(s) "
            f"{', '.join(map(str, missing))} never joined ({told}); flight records of every rank that could write "
            f"one: {os.path.dirname(path) or '.'}/gt-flight-rank<r>.json (this rank's: {path}); GT_HANG_SECONDS sets "
            f"the wait ({self._hang:g} s)"))

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
