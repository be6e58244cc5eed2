"""Symmetric dry runs: a meta-tensor program run on one rank per class of alike ranks, not on every rank.

On meta tensors no value exists, so what a rank does is decided by the shapes of its shards and the groups it
talks to. Where every layout of the program splits its tensor evenly, every rank of a mesh holds shards of the
same shapes and runs the same program, each in its own translate of the groups: one rank's run is everyone's,
except for what a rank receives, which depends on its index in the group (an all-reduce of 1 element: rank 0 of
the group receives n-1 chunks, the others one) and is worked out per rank from that index. Where a split is
uneven, the ranks fall into classes per mesh axis (the coordinates along an axis whose shards have the same
shapes whatever the other coordinates are); one rank per combination of classes is run.

Nothing is assumed: every layout a run materialises is checked against every rank's shard shapes (a class split
by a new layout starts the run again with finer classes; a ragged tensor's by its sizes), and what cannot be worked
out from one rank is refused (`Asymmetric`): the caller runs every rank instead. Boxing's point-to-point steps are
recorded per rank from what the step says each rank sends and receives (`boxing/execute._stand_in`); an uneven
all-to-all is taken where its caller says what every member receives (`SoloCommunicator.receives`). Refused:
layouts on part of the mesh (pipeline stages), collectives of host tensors (values), point-to-point messages and
exchanges of Python objects (what the peers hold), the ops that move pieces between particular ranks
(`rank_specific`: flips, recuts, halos, which a rank with nothing to send skips), other uneven all-to-alls, groups
that are not whole mesh axes, and representatives whose shared collectives disagree. Assumed (the program's
part): a rank's control flow depends on its rank only through its shards and its groups, as a global program's
does (`if rank == 0:` would break it).

The run's `comm_log()` events carry the received bytes of every rank they stand for (`CommEvent.by_rank`, read by
`CommLog.per_rank`); a rank's result is its class representative's.
"""
from __future__ import annotations

import gc
import math
import threading
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..layout import Layout
from ..placement import Placement
from ..sbp import Broadcast, Ragged
from .comm import CommEvent, Communicator, all_reduce_recv_bytes, nbytes
from .sim import _capture_rng, _restore_rng


class Asymmetric(Exception):
    """The program does something one rank's run cannot stand for; run every rank."""


class _Refined(Exception):
    """A layout split a class: run again with the finer classes."""


class RankClasses:
    """The ranks of `mesh` (ranks 0..n-1) in classes: per mesh axis, each coordinate's class is the least coordinate
    of its class; a rank's representative is the rank at its classes' least coordinates."""

    def __init__(self, mesh: Placement) -> None:
        n = mesh.size
        if sorted(mesh.flat_ranks) != list(range(n)):
            raise Asymmetric(f"the mesh's ranks {mesh.flat_ranks} are not 0..{n - 1}")
        self.mesh, self.world = mesh, n
        self.coords = [mesh.coord(r) for r in range(n)]
        self.parts = [[0] * k for k in mesh.shape]  # per axis, per coordinate: its class's least coordinate
        self._set_reps()
        self.seen: set = set()
        self.refined = False
        self.broken: Optional[str] = None
        self.calls: dict[int, list] = {}  # representative -> its collectives (kind, axes, what must agree)

    def _set_reps(self) -> None:
        self.rep = [self.mesh.rank_at(tuple(self.parts[a][c] for a, c in enumerate(self.coords[r])))
                    for r in range(self.world)]

    def representatives(self) -> list[int]:
        return sorted(set(self.rep))

    def members(self, q: int) -> list[int]:
        return [r for r in range(self.world) if self.rep[r] == q]

    def refuse(self, why: str) -> None:
        """Refused: noted (a program that catches the exception still ends as refused) and raised."""
        self.broken = self.broken or why
        raise Asymmetric(why)

    def check(self, layout: Any, shape: tuple) -> None:
        """A layout the run materialises: every rank's shard must have its representative's shape."""
        sizes = CHECKING.sizes if layout.ragged_axes else None
        key = (layout, shape, sizes)
        if key in self.seen:
            return
        if layout.ragged_axes and sizes is None:
            self.refuse(f"a ragged layout {layout.sbp} made without its sizes")
        placement = layout.placement
        if placement.size != self.world or sorted(placement.flat_ranks) != list(range(self.world)):
            self.refuse(f"a layout on ranks {placement.flat_ranks}, not the whole mesh of {self.world}")
        shapes = [None] * self.world
        balanced = Layout(placement, tuple(Broadcast() if isinstance(s, Ragged) else s for s in layout.sbp))
        for r, s in zip(placement.flat_ranks, balanced.local_shapes(shape)):
            if sizes is not None:  # a ragged axis's rows: its sizes, per coordinate (raggedtensor/cuts.local_shape)
                s = list(s)
                for a in layout.ragged_axes:
                    s[layout.sbp[a].dim] = sizes[a][placement.coord(r)[a]]
                s = tuple(s)
            shapes[r] = s
        if any(shapes[r] != shapes[self.rep[r]] for r in range(self.world)):
            self._refine(shapes)
        self.seen.add(key)

    def _refine(self, shapes: list) -> None:
        """Finer classes per axis: two coordinates stay alike where every rank at one has the shape of the rank at
        the other with the other coordinates equal (then any rank can be moved to its representative axis by axis,
        its shapes unchanged)."""
        grid = np.empty(self.mesh.shape, dtype=object)
        for r in range(self.world):
            grid[self.coords[r]] = shapes[r]
        for a, k in enumerate(self.mesh.shape):
            signature = [(self.parts[a][x], tuple(np.take(grid, x, axis=a).ravel().tolist())) for x in range(k)]
            first: dict = {}
            self.parts[a] = [first.setdefault(sig, x) for x, sig in enumerate(signature)]
        self._set_reps()
        self.refined = True
        raise _Refined()

    def indices(self, group: tuple, rank: int, members: list) -> tuple[dict[int, int], tuple]:
        """Each member's index in its own translate of `group` (a whole-axes group of `rank`'s), and the axes."""
        coords = [self.coords[m] for m in group]
        axes = [a for a in range(self.mesh.ndim) if len({c[a] for c in coords}) > 1]
        mine = self.coords[rank]
        at = {tuple(c[a] for a in axes): k for k, c in enumerate(coords)}
        if (len(at) != len(group) or len(group) != math.prod(self.mesh.shape[a] for a in axes)
                or any(c[a] != mine[a] for c in coords for a in range(self.mesh.ndim) if a not in axes)):
            self.refuse(f"a collective on ranks {group}, not whole mesh axes of rank {rank}")
        return {r: at[tuple(self.coords[r][a] for a in axes)] for r in members}, tuple(axes)

    def translate(self, group: tuple, axes: tuple, rank: int) -> tuple:
        """`rank`'s own group of the kind `group` is (the same axes, in the same order)."""
        mine = self.coords[rank]
        return tuple(self.mesh.rank_at(tuple(self.coords[m][a] if a in axes else mine[a]
                                             for a in range(self.mesh.ndim))) for m in group)

    def agree(self) -> None:
        """Representatives in different classes must make the same collectives, on the same axes, with the same
        shapes where they are in the same group's translate (their classes agree off the group's axes)."""
        reps = list(self.calls)
        for p in reps[1:]:
            q = reps[0]
            if [c[:2] for c in self.calls[p]] != [c[:2] for c in self.calls[q]]:
                self.refuse(f"ranks {q} and {p} make different collectives")
        for i, p in enumerate(reps):
            for q in reps[i + 1:]:
                for (kind, axes, what), (_, _, other) in zip(self.calls[p], self.calls[q]):
                    same = all(self.parts[a][self.coords[p][a]] == self.parts[a][self.coords[q][a]]
                               for a in range(self.mesh.ndim) if a not in axes)
                    if same and what != other:
                        self.refuse(f"ranks {q} and {p} disagree on a {kind}: {other} and {what}")


class SoloCommunicator(Communicator):
    """Rank `rank` run alone, standing for `members` (itself among them): each collective returns meta tensors of
    the shapes its peers would send, at once, and records what every member would receive."""

    def __init__(self, classes: RankClasses, rank: int) -> None:
        super().__init__()
        self.classes, self.rank, self.world_size = classes, rank, classes.world
        self.device = torch.device("meta")
        self.members = classes.members(rank)
        self._bytes_at: Optional[Callable[[int], int]] = None
        # set just before an uneven all-to-all by a caller that knows every member's receives (boxing's boxes, a
        # ragged recut's overlaps, which every rank works out alike): (a rank's group, its index there) -> the
        # elements it receives from each member
        self.receives: Optional[Callable[[tuple, int], list]] = None
        self._at: dict = {}
        self._calls = classes.calls.setdefault(rank, [])

    def device_for(self, device_type: str) -> torch.device:
        return self.device

    def _note(self, kind: str, group: tuple, tensors: list, what: Any, bytes_at: Callable[[int], int]) -> int:
        for t in tensors:
            if not t.is_meta:
                self.classes.refuse(f"a {kind} of a {t.device.type} tensor (its values)")
        group = tuple(group)
        if group not in self._at:
            self._at[group] = self.classes.indices(group, self.rank, self.members)
        self._calls.append((kind, self._at[group][1], what))
        self._bytes_at = bytes_at
        return group.index(self.rank)

    def _record(self, kind: str, group: tuple, recv_bytes: int) -> None:
        at = self._at[tuple(group)][0]
        by_rank = tuple((r, int(self._bytes_at(i, r))) for r, i in at.items())
        ev = CommEvent(kind, tuple(group), int(recv_bytes), self.topology.crosses(group), by_rank)
        for log in self._logs:
            log.add(ev)

    def record_for(self, kind: str, group: tuple, rank: int, recv_bytes: int) -> None:
        """A communication only `rank` (one this run stands for) makes, receiving `recv_bytes` (boxing's
        point-to-point steps: `boxing/execute.py`)."""
        if self._logs:
            ev = CommEvent(kind, tuple(group), recv_bytes if rank == self.rank else 0, self.topology.crosses(group),
                           ((rank, int(recv_bytes)),))
            for log in self._logs:
                log.add(ev)

    def _all_gather(self, t, group, shapes):
        i = self._note("all_gather", group, [t], (t.dtype, tuple(shapes)),
                       lambda i, r: sum(nbytes(s, t.dtype) for j, s in enumerate(shapes) if j != i))
        return [t if j == i else t.new_empty(s) for j, s in enumerate(shapes)]

    def _reduce_scatter(self, chunks, group, op):
        n = len(group)
        i = self._note("reduce_scatter", group, list(chunks), (op, chunks[0].dtype, tuple(c.shape for c in chunks)),
                       lambda i, r: (n - 1) * chunks[i].numel() * chunks[i].element_size())
        return torch.empty_like(chunks[i])

    def _all_reduce(self, t, group, op):
        n = len(group)
        self._note("all_reduce", group, [t], (op, t.dtype, tuple(t.shape)),
                   lambda i, r: all_reduce_recv_bytes(t.numel(), t.element_size(), n, i))
        return torch.empty_like(t)

    def _all_to_all_into(self, send, send_splits, recv, recv_splits, group):
        receives, self.receives = self.receives, None
        if receives is None and (len(set(send_splits)) > 1 or len(set(recv_splits)) > 1):
            self.classes.refuse(f"an uneven all_to_all (splits {list(send_splits)} / {list(recv_splits)})")
        group = tuple(group)
        if receives is None:
            receives = lambda g, j: [recv_splits[0]] * len(g)  # noqa: E731
        elif list(receives(group, group.index(self.rank))) != list(recv_splits):
            self.classes.refuse(f"an all_to_all whose receives {list(recv_splits)} are not the ones its caller "
                                f"worked out ({receives(group, group.index(self.rank))})")

        def bytes_at(i: int, r: int) -> int:
            got = receives(self.classes.translate(group, self._at[group][1], r), i)
            return (sum(got) - got[i]) * recv.element_size()
        self._note("all_to_all", group, [send, recv], (send.dtype,), bytes_at)  # the splits are each member's own

    def _broadcast(self, t, group, src, shape, dtype):
        at = group.index(src)
        self._note("broadcast", group, [] if t is None else [t], (at, tuple(shape), dtype),
                   lambda i, r: 0 if i == at else nbytes(shape, dtype))
        return t if self.rank == src else torch.empty(shape, dtype=dtype, device=self.device)

    def exchange(self, sends, recvs, into=None, device=None, key=0):
        self.classes.refuse("a point-to-point exchange (its ends are ranks of their own)")

    def send_recv_start(self, sends, recvs, key=0, device=None):
        self.classes.refuse("a point-to-point exchange (its ends are ranks of their own)")

    def post_receive(self, src, shape, dtype, key=0, device=None):
        self.classes.refuse("a point-to-point exchange (its ends are ranks of their own)")

    def _all_gather_object(self, obj, group):
        self.classes.refuse("an exchange of Python objects (what the peers hold)")

    def flush_sends(self) -> None:
        pass


class _Checking:
    """Process-wide, as a dry run is (one at a time): threads the program starts (fibers) are checked too."""
    classes: Optional[RankClasses] = None
    sizes: Any = None  # a ragged tensor's sizes while it is made (RaggedTensor.make): its shards' shapes


CHECKING = _Checking()  # read by GlobalTensor's wrapper (tensor.py): the classes every new layout is checked against


def rank_specific(what: str) -> None:
    """Called by every rank where a mechanism works out which pieces particular ranks send each other (boxing's
    point-to-point steps, ops' moves of pieces): a rank may have nothing to send there while its neighbour has,
    which one rank's run cannot see. Refused in a symmetric run (a no-op elsewhere)."""
    classes = CHECKING.classes
    if classes is not None:
        classes.refuse(what)


def run(body: Callable[[Communicator], Any], mesh: Placement) -> list:
    """`body(communicator)` on one rank per class of `mesh`'s ranks (each on a thread of its own, one at a time);
    every rank's result, in rank order (its representative's). Raises `Asymmetric` where one rank cannot stand
    for its class; the program's own errors as they are."""
    classes = RankClasses(mesh)
    initial = _capture_rng()
    while True:
        classes.refined, classes.calls = False, {}
        results: dict = {}
        try:
            for q in classes.representatives():
                results[q] = _alone(body, classes, q, initial)
                if classes.refined:
                    break
        except (_Refined, Asymmetric):
            pass
        finally:
            _restore_rng(initial)
        if classes.broken:
            raise Asymmetric(classes.broken)
        if classes.refined:
            continue
        classes.agree()
        return [results[classes.rep[r]] for r in range(classes.world)]


def _alone(body: Callable[[Communicator], Any], classes: RankClasses, rank: int, initial: tuple) -> Any:
    comm = SoloCommunicator(classes, rank)
    out: dict = {}

    def main() -> None:
        _restore_rng(initial)
        CHECKING.classes = classes
        try:
            with torch.autograd.set_multithreading_enabled(False):
                out["result"] = body(comm)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            out["error"] = e
        finally:
            CHECKING.classes = None

    thread = threading.Thread(target=main, name=f"gt-solo-rank{rank}", daemon=True)
    thread.start()
    thread.join()
    if classes.broken or classes.refined:  # whatever the program made of the exception it was handed
        # the run stopped midway: what it held (gathered parameters, which `zero.gathered_bytes` counts while
        # they live) goes now, not at some later collection inside the next run
        out.clear()
        gc.collect()
        raise _Refined() if not classes.broken else Asymmetric(classes.broken)
    if "error" in out:
        raise out["error"]
    return out["result"]


__all__ = ["Asymmetric", "RankClasses", "SoloCommunicator", "rank_specific", "run"]
