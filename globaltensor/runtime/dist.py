"""The torch.distributed backend (gloo on CPU, nccl on GPU), as run by torchrun or gt.launch."""
from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from .comm import Communicator
from .failure import CollectiveError, default_timeout
from .topology import Topology, default_for, install
from .watch import CollectiveWatch, enabled as _watch_enabled, exit_with

# torch >= 2.12 renamed the single-tensor collectives; keep older torch working
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _one_buffer(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat buffer that equal, contiguous `parts` fill back to back, if they do (no copy)."""
    first = parts[0]
    size, step = first.numel(), first.numel() * first.element_size()
    if size == 0 or any(p.numel() != size or not p.is_contiguous() or p.dtype != first.dtype for p in parts):
        return None
    if any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or
           p.data_ptr() != first.data_ptr() + i * step for i, p in enumerate(parts)):
        return None
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (size * len(parts),))
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
GLOO_SENDS_FROM_BYTES = 8 << 20  # all-gathers at least this large (output bytes) run as sends on gloo (`_all_gather_by_sends`)
_GATHER_TAG = 1 << 24  # their messages' tag: apart from the pipeline's (micro-batch numbers) on the same pairs
_REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}  # over the received pieces (gloo's reduce-scatter)


def _waited(work, wait: bool):
    """The work, waited for first if `wait` (inside the collective watch's bracket: a rank blocked there is
    named as waiting in that collective)."""
    if wait:
        work.wait()
    return work


def _explain(watch: CollectiveWatch | None) -> str:
    """What the peers posted about a failed collective (one of them finished, or waits elsewhere)."""
    try:
        return watch.explain() if watch is not None else ""
    except Exception:  # noqa: BLE001 - the store is gone too: gloo's own message is all there is
        return ""


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TorchDistCommunicator(Communicator):
    def __init__(self) -> None:
        super().__init__()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()
        self.posts_receives_ahead = self.backend != "nccl"
        if self.backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", self.rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        self._groups: dict[tuple, object] = {}
        self._a2a_args: dict[tuple, tuple] = {}
        self._in_flight: list = []  # (work, tensor) of asynchronous sends (p2p_async)
        self._watch: CollectiveWatch | None = None
        self.topology = Topology.from_environment()
        install(default_for(self.backend))

    def watch_collectives(self, fail=exit_with) -> None:
        """Name a mismatched collective within seconds instead of waiting out the timeout (`runtime/watch.py`).

        gloo only (nccl's calls return before they complete); `GT_CHECK_COLLECTIVES=0` turns it off.
        `fail(error)` runs on the watcher thread and must end the process (the rank is stuck in gloo).
        """
        if self.backend == "gloo" and _watch_enabled() and self._watch is None and self.world_size > 1:
            self._watch = CollectiveWatch(dist.distributed_c10d._get_default_store(), self.rank, fail)

    def finish(self) -> None:
        """The program returned on this rank: peers still waiting for it learn so (see watch_collectives)."""
        if self._watch is not None:
            self._watch.finish()

    @classmethod
    def init(cls, backend: str, rank: int, world_size: int, init_method: str, timeout: float
             ) -> "TorchDistCommunicator":
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        return cls()

    @classmethod
    def from_environment(cls) -> "TorchDistCommunicator":
        """Use an initialised default group, or create one from torchrun's environment."""
        created = not dist.is_initialized()
        if created:
            backend = "nccl" if torch.cuda.is_available() and os.environ.get("GT_BACKEND") != "gloo" else "gloo"
            backend = os.environ.get("GT_BACKEND", backend)
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=default_timeout()))
        comm = cls()
        comm.watch_collectives()
        if created:
            # the group made here is ended here (after `finish`: atexit runs last-registered first); one left to the
            # interpreter's teardown made about one torchrun run in five exit 1 after training (a gloo worker
            # aborting with "terminate called without an active exception")
            atexit.register(_destroy)
        atexit.register(comm.finish)
        return comm

    # -- groups: torch orders a group's members by global rank; ours are in mesh order
    def _pg(self, group: tuple):
        key = tuple(sorted(group))
        pg = self._groups.get(key)
        if pg is None:
            if len(key) == self.world_size:
                pg = dist.group.WORLD
            else:
                pg = dist.new_group(list(key), use_local_synchronization=True)
            self._groups[key] = pg
        return pg

    def _call(self, kind: str, group: tuple, fn, what: object = ""):
        """Run one collective; `what` (its sizes, the same on every member) is what the watch compares."""
        watch = self._watch
        if watch is not None:
            watch.enter(kind, group, what)
        try:
            return fn()
        except RuntimeError as e:
            why = _explain(watch)
            raise CollectiveError(f"{kind} on group {group} failed on rank {self.rank}: "
                                  f"{why + ' (collective mismatch); gloo said: ' if why else ''}{e}") from e
        finally:
            if watch is not None:
                watch.leave()

    def _all_gather(self, t, group, shapes):
        return self._all_gather_start(t, group, shapes, wait=True)()

    _async_gather = True

    def _all_gather_start(self, t, group, shapes, wait=False):
        """Started now, finished by calling the result; `wait`: finished inside the collective watch's
        bracket (a rank blocked in it is named as waiting in this all-gather)."""
        numels = [torch.Size(s).numel() for s in shapes]
        if max(numels) == 0:
            return lambda: [t.new_empty(s) for s in shapes]
        if self.backend == "gloo" and sum(numels) * t.element_size() >= GLOO_SENDS_FROM_BYTES:
            return self._all_gather_by_sends(t.reshape(-1), group, shapes, numels, wait)
        order = sorted(group)
        width = max(numels)
        flat = t.reshape(-1)
        if flat.numel() < width:
            flat = torch.cat([flat, flat.new_empty(width - flat.numel())])
        buf = t.new_empty(width * len(group))
        work = self._call("all_gather", group, lambda: _waited(_all_gather_single(
            buf, flat, group=self._pg(group), async_op=True), wait), (width, t.dtype))
        pos = {r: k for k, r in enumerate(order)}

        def finish():
            try:
                if not wait:
                    work.wait()
            except RuntimeError as e:
                raise CollectiveError(f"all_gather on group {group} failed on rank {self.rank}: {e}") from e
            return [buf[pos[r] * width: pos[r] * width + numels[j]].view(shapes[j]) for j, r in enumerate(group)]
        return finish

    def _all_gather_by_sends(self, flat, group, shapes, numels, wait):
        """An all-gather as one send of this rank's piece to each peer and one receive from each, straight
        into the output (no padding). gloo's all-gather relays every piece round a ring through a flat
        buffer of its own, then copies it out, and holds that second output while in flight; at 48 MiB
        out the sends take 0.84-0.92x its time on 2 and 4 loopback ranks, at 4 MiB 1.07-1.14x
        (`bench/collectives.py`): below `GLOO_SENDS_FROM_BYTES` gloo's one collective call is kept."""
        pg = self._pg(group)
        at = [0]
        for k in numels:
            at.append(at[-1] + k)
        buf = flat.new_empty(at[-1])
        me = group.index(self.rank)

        def post():
            works = []
            for j, r in enumerate(group):
                if r == self.rank:
                    continue
                if numels[me]:
                    works.append(dist.isend(flat, r, group=pg, tag=_GATHER_TAG))
                if numels[j]:
                    works.append(dist.irecv(buf[at[j]:at[j + 1]], r, group=pg, tag=_GATHER_TAG))
            buf[at[me]:at[me + 1]].copy_(flat)
            if wait:  # each once: waiting on a gloo send again waits for another send
                for w in works:
                    w.wait()
                works.clear()
            return works
        works = self._call("all_gather", group, post, (max(numels), flat.dtype))

        def finish():
            try:
                for w in works:
                    w.wait()
            except RuntimeError as e:
                raise CollectiveError(f"all_gather on group {group} failed on rank {self.rank}: {e}") from e
            works.clear()  # the sent piece is kept alive until here
            return [buf[at[j]:at[j + 1]].view(shapes[j]) for j in range(len(group))]
        return finish

    def _reduce_scatter_start(self, chunks, group, op):
        """Left in flight: on gloo always, elsewhere where the chunks are one buffer (else None)."""
        return self._reduce_scatter_any(chunks, group, op, async_op=True)

    def _reduce_scatter(self, chunks, group, op):
        return self._reduce_scatter_any(chunks, group, op, async_op=False)()

    def _reduce_scatter_any(self, chunks, group, op, async_op):
        """Reduce-scatter, finished by calling the result.

        gloo's reduce-scatter is an all-reduce of a copy of its input with the own chunk kept: each rank
        receives 2 (n-1)/n of the buffer, not the (n-1)/n a reduce-scatter needs. On gloo it runs instead
        as the all-to-all that is a reduce-scatter's first half (each rank receives every peer's piece
        of its own chunk: the textbook bytes) and a local reduction of the n pieces: 0.63-0.92x gloo's
        time at 4 and 48 MiB on 2 and 4 loopback ranks (`bench/collectives.py`). The reduction
        runs as the all-to-all's completion callback (gloo's thread), so its receive buffer and the send
        buffer are freed when it lands, not when the caller comes to finish it (a ZeRO gradient bucket
        left in flight across the next module's backward). nccl keeps its own."""
        order = sorted(group)
        by_rank = dict(zip(group, chunks))
        inputs = [by_rank[r] for r in order]
        out = torch.empty_like(by_rank[self.rank])
        flat = _one_buffer(inputs)
        pg = self._pg(group)
        what = (sum(t.numel() for t in inputs), out.dtype, op)
        if self.backend == "gloo":
            sizes = [t.numel() for t in inputs]
            even = len(set(sizes)) == 1
            n = len(group)

            def send():
                send = flat if flat is not None else torch.cat([t.reshape(-1) for t in inputs])
                return dist.all_to_all_single(out.new_empty(out.numel() * n), send,
                                              None if even else [out.numel()] * n, None if even else sizes,
                                              group=pg, async_op=True)

            def reduce(fut) -> torch.Tensor:  # no reference to the buffers: the work's own, freed with it
                _REDUCE[op](fut.value()[0].view(n, -1), 0, out=out.view(-1))
                return out
            done = self._call("reduce_scatter", group, lambda: _waited(send(), not async_op), what
                              ).get_future().then(reduce)
            del flat, inputs, by_rank, chunks
        elif flat is not None:
            done = self._call("reduce_scatter", group, lambda: _waited(_reduce_scatter_single(
                out.view(-1), flat, op=OPS[op], group=pg, async_op=True), not async_op), what).get_future()
        elif async_op:
            return None
        else:
            self._call("reduce_scatter", group, lambda: dist.reduce_scatter(out, inputs, op=OPS[op], group=pg), what)
            done = None

        def finish():
            if done is not None:
                try:
                    done.wait()
                except RuntimeError as e:
                    raise CollectiveError(f"reduce_scatter on group {group} failed on rank {self.rank}: {e}") from e
            return out
        return finish

    def _all_reduce(self, t, group, op):
        out = t.clone()
        self._call("all_reduce", group, lambda: dist.all_reduce(out, op=OPS[op], group=self._pg(group)),
                   (out.numel(), out.dtype, op))
        return out

    # -- under torch.compile: torch's functional collectives (`_c10d_functional`), which inductor schedules --
    # Each is issued and waited for at once (`wait_tensor`); inductor may move the wait later to overlap. They
    # run on torch.distributed's process groups, not through this communicator: `gt.comm_log()` does not see
    # them (the graph lists them), nor does the collective watch. What they cannot express (uneven pieces of an
    # all-gather or reduce-scatter, a group whose mesh order is not rank order) records our own op instead.
    def _group_name(self, group: tuple) -> str:
        return self._pg(group).group_name

    def _traced_all_reduce(self, t, group, op):
        out = torch.ops._c10d_functional.all_reduce(t, op, self._group_name(group))
        return torch.ops._c10d_functional.wait_tensor(out)

    def _traced_all_gather(self, t, group, shapes):
        if list(group) != sorted(group) or len(set(shapes)) != 1:
            return super()._traced_all_gather(t, group, shapes)
        out = torch.ops._c10d_functional.all_gather_into_tensor(t.reshape(-1), len(group), self._group_name(group))
        out = torch.ops._c10d_functional.wait_tensor(out)
        return [piece.view(shapes[j]) for j, piece in enumerate(out.chunk(len(group)))]

    def _traced_reduce_scatter(self, chunks, group, op, i):
        if list(group) != sorted(group) or len({tuple(c.shape) for c in chunks}) != 1:
            return super()._traced_reduce_scatter(chunks, group, op, i)
        flat = torch.cat([c.reshape(-1) for c in chunks])
        out = torch.ops._c10d_functional.reduce_scatter_tensor(flat, op, len(group), self._group_name(group))
        return torch.ops._c10d_functional.wait_tensor(out).view(chunks[i].shape)

    def _traced_all_to_all(self, send, send_splits, recv_splits, group):
        if list(group) != sorted(group):
            return super()._traced_all_to_all(send, send_splits, recv_splits, group)
        out = torch.ops._c10d_functional.all_to_all_single(send, list(recv_splits), list(send_splits),
                                                           self._group_name(group))
        return torch.ops._c10d_functional.wait_tensor(out)

    def _all_to_all_into(self, send, send_splits, recv, recv_splits, group):
        key = (group, tuple(send_splits), tuple(recv_splits))
        args = self._a2a_args.get(key)
        if args is None:  # worked out once per (group, splits): a compiled route repeats them
            even = len(set(send_splits)) == 1 and len(set(recv_splits)) == 1  # gloo's even path beats alltoallv
            args = (self._pg(group) if list(group) == sorted(group) else None,
                    None if even else list(recv_splits), None if even else list(send_splits))
            if even:  # uneven splits are data-dependent (a dropless dispatch's): remembered, they would pile up
                self._a2a_args[key] = args
        pg, out_splits, in_splits = args
        if pg is None:  # torch orders segments by global rank: permute (a mesh order that is not rank order)
            self._all_to_all_permuted(send, send_splits, recv, recv_splits, group)
            return
        self._call("all_to_all", group, lambda: dist.all_to_all_single(recv, send, out_splits, in_splits, group=pg),
                   (len(group), send.dtype))

    def _all_to_all_permuted(self, send, send_splits, recv, recv_splits, group):
        order = tuple(sorted(group))
        pos = [group.index(r) for r in order]
        sends, recvs = send.split(list(send_splits)), recv.split(list(recv_splits))
        inner = recv.new_empty(recv.numel())
        self._all_to_all_into(torch.cat([sends[k] for k in pos]), [send_splits[k] for k in pos], inner,
                              [recv_splits[k] for k in pos], order)
        for k, piece in zip(pos, inner.split([recv_splits[k] for k in pos])):
            recvs[k].copy_(piece)

    def _exchange(self, sends, bufs, tag=0):
        watch = self._watch
        if watch is not None:
            watch.enter("send_recv", tuple(sorted(set(sends) | set(bufs) | {self.rank})), self._p2p_what())
        try:
            if self.backend == "nccl":  # nccl pairs sends and receives only when they are coalesced
                ops = [dist.P2POp(dist.isend, t, dst) for dst, t in sorted(sends.items())]
                ops += [dist.P2POp(dist.irecv, t, src) for src, t in sorted(bufs.items())]
                works = dist.batch_isend_irecv(ops)
            else:  # what batch_isend_irecv does for gloo, without building and checking P2POps
                sent = [(dist.isend(t, dst, tag=tag), t) for dst, t in sorted(sends.items())]  # noqa: E501
                works = [dist.irecv(t, src, tag=tag) for src, t in sorted(bufs.items())]
                if self.p2p_async:  # the send's tensor stays alive until flush_sends
                    self._in_flight.extend(sent)
                else:
                    works += [w for w, _ in sent]
            for w in works:
                w.wait()
        except RuntimeError as e:
            peers = tuple(sorted(set(sends) | set(bufs) | {self.rank}))
            raise CollectiveError(f"send_recv on group {peers} failed on rank {self.rank}: {e}") from e
        finally:
            if watch is not None:
                watch.leave()

    def _exchange_start(self, sends, bufs, tag=0):
        """isend/irecv now, waited for in the result (nccl: one coalesced batch, as `_exchange`)."""
        peers = tuple(sorted(set(sends) | set(bufs) | {self.rank}))
        what = self._p2p_what()
        sent = list(sends.values())
        try:
            if self.backend == "nccl":
                ops = [dist.P2POp(dist.isend, t, dst) for dst, t in sorted(sends.items())]
                ops += [dist.P2POp(dist.irecv, t, src) for src, t in sorted(bufs.items())]
                works = dist.batch_isend_irecv(ops)
            else:
                works = [dist.isend(t, dst, tag=tag) for dst, t in sorted(sends.items())]
                works += [dist.irecv(t, src, tag=tag) for src, t in sorted(bufs.items())]
        except RuntimeError as e:
            raise CollectiveError(f"send_recv on group {peers} failed on rank {self.rank}: {e}") from e

        def finish():
            watch = self._watch
            if watch is not None:
                watch.enter("send_recv", peers, what)
            try:
                for w in works:
                    w.wait()
            except RuntimeError as e:
                raise CollectiveError(f"send_recv on group {peers} failed on rank {self.rank}: {e}") from e
            finally:
                if watch is not None:
                    watch.leave()
            sent.clear()  # the sent tensors are kept alive until here
            return bufs
        return finish

    def flush_sends(self) -> None:
        """Wait for the asynchronous sends. A peer that failed closed its connection: that is a consequence
        (a CollectiveError), so the peer's own error, not this one, is the one `launch` re-raises."""
        flying, self._in_flight = self._in_flight, []
        for w, _ in flying:
            try:
                w.wait()
            except RuntimeError as e:
                raise CollectiveError(f"a send of rank {self.rank} failed: {e}") from e

    def _p2p_what(self) -> str:
        return f"point-to-point, {self.p2p_label}" if self.p2p_label else "point-to-point"

    def _broadcast(self, t, group, src, shape, dtype):
        buf = t.clone() if self.rank == src else torch.empty(shape, dtype=dtype, device=self.device)
        self._call("broadcast", group, lambda: dist.broadcast(buf, src=src, group=self._pg(group)),
                   (tuple(shape), dtype, src))
        return buf

    def _all_gather_object(self, obj, group):
        order = sorted(group)
        out = [None] * len(group)
        self._call("all_gather_object", group,
                   lambda: dist.all_gather_object(out, obj, group=self._pg(group)), "objects")
        by_rank = dict(zip(order, out))
        return [by_rank[r] for r in group]
