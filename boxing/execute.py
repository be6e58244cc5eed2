"""The executor: walk a route's steps on a Communicator (the same code for every backend).

Each primitive works on this rank's local tensor only; slices stay views and
a buffer is allocated only where the result is assembled from several pieces.
A route is compiled once per rank into calls whose boxes, groups and shapes
are worked out (`Route.programs`), so running a cached route is the
collectives and a few slices.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Optional, Sequence

import torch

from ..layout import Layout, slice_box
from ..runtime.comm import Communicator
from ..runtime.graph_ops import traced as _traced
from ..runtime.symmetry import CHECKING as _SYMMETRY, rank_specific
from ..runtime.trace import FLAGS as _TRACING, pop_route, push_route
from .boxes import identity, intersect, numel, relative, sizes
from .pack import Tiling
from .route import Route, Step
from .search import route as find_route
from .strided import ReadingStep
from .zigzag import COMPILE as _ZIGZAG_COMPILE


def execute(route: Route, local: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Run `route` on this rank's shard; returns the shard of the target layout (empty outside it)."""
    if _SYMMETRY.classes is not None and _point_to_point(route):  # a symmetric dry run (runtime/symmetry.py)
        return _stand_in(route, local, comm)
    key = (comm.rank, comm.world_size)
    program = route.programs.get(key)
    if program is None:
        _check_world(route, comm)
        program = route.programs[key] = _compile(route, comm.rank)
    if _TRACING.on:  # a gt.comm_report() is open: its collectives name this route as their conversion
        push_route(route)
        try:
            for run in program:
                local = run(local, comm)
        finally:
            pop_route()
        return local
    for run in program:
        local = run(local, comm)
    return local


# the steps every rank runs alike, up to its shard's shape and its index in the axis group
_SYMMETRIC = frozenset({"all_gather", "all_to_all", "reduce_scatter", "all_reduce", "slice", "fill", "pad"})
_POINT_TO_POINT = frozenset({"send_recv", "broadcast", "local"})  # `_exchange`: each rank's messages its own


def _point_to_point(route: Route) -> bool:
    """Whether the route has point-to-point steps (refused inside a strided reading, or a step of another kind)."""
    found = False
    for step in route.steps:
        if isinstance(step, ReadingStep):
            if _point_to_point(step.sub):
                rank_specific(f"a point-to-point step inside a strided reading ({step})")
        elif step.primitive in _POINT_TO_POINT:
            found = True
        elif step.primitive not in _SYMMETRIC:
            rank_specific(f"a conversion's {step.primitive} step")
    return found


def _stand_in(route: Route, local: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The route in a symmetric dry run (meta shards): its collectives as every rank runs them, and for each
    point-to-point step what each rank the run stands for would send and receive (`Step.exchanges` knows every
    rank's), recorded for that rank, the output a meta shard of the step's shape (the same on each, or refused)."""
    for step in route.steps:
        if isinstance(step, ReadingStep) or step.primitive not in _POINT_TO_POINT:
            run = (_reading if isinstance(step, ReadingStep) else _COMPILE[step.primitive])(step, route.shape,
                                                                                            comm.rank)
            local = run(local, comm) if run is not None else local
            continue
        mine = step.exchange(comm.rank)
        size = local.element_size()
        for r in comm.members:
            part = step.exchange(r)
            if (part is None) != (mine is None) or (part is not None and part.out_shape != mine.out_shape):
                rank_specific(f"a point-to-point step whose ranks hold shards of other shapes ({step})")
            if part is None:
                continue
            for group, src, _, n in part.bcasts:
                if len(group) > 1:
                    comm.record_for("broadcast", group, r, 0 if src == r else n * size)
            if part.sends or part.recvs:
                peers = tuple(sorted({p for p, _ in part.sends} | {p for p, _ in part.recvs} | {r}))
                comm.record_for("send_recv", peers, r, sum(numel(b) for _, bs in part.recvs for b in bs) * size)
        if mine is not None:
            inside = comm.rank in step.dst.placement
            local = local.new_empty(mine.out_shape if inside else (0,))
    if comm.rank not in route.dst.placement:
        local = local.new_empty((0,))
    return local


def _compile(route: Route, rank: int) -> tuple[Callable, ...]:
    """This rank's steps as calls with every box, group and shape worked out once (routes are cached)."""
    program = [(_reading if isinstance(step, ReadingStep) else _COMPILE[step.primitive])(step, route.shape, rank)
               for step in route.steps]
    if rank not in route.dst.placement:
        program.append(lambda local, comm: local.new_empty((0,)))
    return tuple(p for p in program if p is not None)


def _reading(step: ReadingStep, shape: tuple, rank: int) -> Callable:
    """A route run on the unflattened reading of a strided dim (`boxing/strided.py`): the local shard
    unflattened into (groups, piece), the sub-route's steps, and flattened back."""
    program = _compile(step.sub, rank)
    d, g, ndim = step.dim, step.groups, len(shape)

    def run(local: torch.Tensor, comm: Communicator) -> torch.Tensor:
        if local.dim() == ndim:
            local = local.unflatten(d, (g, -1))
        for p in program:
            local = p(local, comm)
        return local.flatten(d, d + 1) if local.dim() == ndim + 1 else local
    return run


def _check_world(route: Route, comm: Communicator) -> None:
    if route.world > comm.world_size:
        bad = sorted(r for r in set(route.src.placement.flat_ranks + route.dst.placement.flat_ranks)
                     if r >= comm.world_size)
        raise ValueError(f"to_global(placement): ranks {bad} are not in the world of size {comm.world_size}; "
                         f"use ranks 0..{comm.world_size - 1} or launch more processes")


def all_reduce_key(route: Route) -> Optional[tuple]:
    """(placement, mesh axis, dtype, op) when `route` is exactly one all-reduce, else None.

    Routes with equal keys reduce over the same rank groups, so their shards can share one collective.
    """
    key = bucket_key(route)
    return None if key is None or key[0] != "all_reduce" else key[1:]


_BUCKETED = ("all_reduce", "all_gather", "reduce_scatter")


def bucket_key(route: Route) -> Optional[tuple]:
    """(primitive, placement, mesh axis, dtype, op) when `route` is exactly one all-reduce, all-gather or
    reduce-scatter, else None. Routes with equal keys run over the same rank groups: one collective can
    carry all their shards (a gradient bucket, a module's parameters gathered at once)."""
    if len(route.steps) != 1 or route.steps[0].primitive not in _BUCKETED:
        return None
    step = route.steps[0]
    return step.primitive, step.src.placement, step.axis, route.dtype, step.op


def execute_many(routes: Sequence[Route], locals_: Sequence[torch.Tensor], comm: Communicator
                 ) -> list[torch.Tensor]:
    """`execute` for several shards, with the routes that are one collective on a common key coalesced.

    Each such bucket is packed into one flat buffer and moved by ONE collective (DDP's gradient
    bucket, FSDP's per-module all-gather and reduce-scatter); the communicator records the
    buffer's real bytes, which are the sum of the routes' bytes (uneven shards included: each
    member's piece is its own size). Other routes run one by one. Every rank must pass the same
    routes in the same order; buckets run in order of first appearance.
    """
    return execute_many_start(routes, locals_, comm)()


def execute_many_start(routes: Sequence[Route], locals_: Sequence[torch.Tensor], comm: Communicator
                       ) -> Callable[..., list[torch.Tensor]]:
    """`execute_many` started now, finished by calling the result: its all-gather and reduce-scatter
    buckets may stay in flight meanwhile (a prefetch of the next module's parameters, a gradient
    bucket reduced while the backward goes on); everything else runs now.

    The result takes `into`, optionally: per route a tensor of the result's shape and dtype to fill (ZeRO-3's
    freed parameters, gathered again into their own storage), or None; it returns those tensors. An
    all-gather bucket of even rows copies out straight into them (one copy of the parameters, not two).

    What does not depend on the values (which routes share a bucket, each member's boxes and sizes,
    whether a bucket's pieces are even rows) is worked out once per list of routes and rank: ZeRO asks
    for the same lists every step, and a small model's step is bound by such per-call work."""
    key = (tuple(map(id, routes)), comm.rank, comm.world_size)
    hit = _MANY.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], routes)):
        if len(_MANY) >= MAX_MANY:
            _MANY.clear()
        for p in routes:
            _check_world(p, comm)
        hit = _MANY[key] = (tuple(routes), _compile_many(routes, comm.rank))
    return hit[1](locals_, comm)


MAX_MANY = 4096
_MANY: dict = {}  # (route ids, rank, world) -> (the routes, kept alive so the ids stay theirs; the program)


def _compile_many(routes: Sequence[Route], rank: int) -> Callable:
    singles: list[int] = []
    buckets: dict[tuple, list[int]] = {}
    for i, p in enumerate(routes):
        key = bucket_key(p)
        if key is None:
            singles.append(i)
        else:
            buckets.setdefault(key, []).append(i)
    outside: list[int] = []
    started, runs = [], []  # (members, start(locals, comm) -> finish), (members, run(locals, comm))
    for (primitive, placement, axis, _, op), members in buckets.items():
        if len(members) == 1:
            singles.append(members[0])
        elif rank not in placement:
            outside += members
        else:
            group = placement.group(rank, axis)
            compiled = (members, _BUCKETS[primitive]([routes[i] for i in members], group, op, rank))
            (started if primitive in _STARTED else runs).append(compiled)
    singles.sort()
    n = len(routes)

    def start(locals_: Sequence[torch.Tensor], comm: Communicator) -> Callable[[], list[torch.Tensor]]:
        out: list = [None] * n
        for i in singles:
            out[i] = execute(routes[i], locals_[i], comm)
        for i in outside:
            out[i] = locals_[i].new_empty((0,))
        pending = [(members, begin([locals_[i] for i in members], comm)) for members, begin in started]
        for members, run in runs:
            for i, o in zip(members, run([locals_[i] for i in members], comm)):
                out[i] = o

        def finish(into: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[torch.Tensor]:
            for members, done in pending:
                for i, o in zip(members, done(None if into is None else [into[i] for i in members])):
                    out[i] = o
            if into is not None:
                for i, t in enumerate(into):
                    if t is not None and out[i] is not t:
                        out[i] = t.copy_(out[i])
            return out
        return finish
    return start


def _all_reduce_bucket(routes, group, op, rank) -> Callable:
    def run(locals_, comm) -> list[torch.Tensor]:
        flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in locals_]), group, op)
        return [piece.view(t.shape) for t, piece in zip(locals_, flat.split([t.numel() for t in locals_]))]
    return run


def _all_gather_bucket(routes, group, op, rank) -> Callable:
    """One all-gather of every shard back to back; each member's piece holds its shards in route order.

    When every shard is an equal share of dim 0 (FSDP's case), the gathered buffer, read as [members,
    piece], holds each parameter as a block of columns: one `split_with_sizes_copy` puts them all in
    place (FSDP2's copy-out), instead of a view and a cat per parameter."""
    shapes = [[p.steps[0].src.local_shape(p.shape, r) for r in group] for p in routes]
    numels = [[math.prod(s) for s in per] for per in shapes]  # [route][member]
    piece_shapes = [(sum(n[j] for n in numels),) for j in range(len(group))]
    dims = [p.steps[0].src.sbp[p.steps[0].axis].dim for p in routes]
    m = len(group)
    full = [p.steps[0].dst.local_shape(p.shape, rank) for p in routes]
    even = all(d == 0 and len(set(per)) == 1 and per[0] and per[0][0] * m == f[0]
               for d, per, f in zip(dims, shapes, full))
    widths = [n[0] for n in numels]
    row = sum(widths)

    def begin(locals_, comm) -> Callable[[], list[torch.Tensor]]:
        done = comm.all_gather_start(torch.cat([t.reshape(-1) for t in locals_]), group, piece_shapes)

        def finish(into: Optional[list] = None) -> list[torch.Tensor]:
            got = done()
            if even:  # the pieces lie back to back in the backend's buffer (gloo), or are put so (simulator)
                rows = _cat(got, 0).view(m, row)  # a view where they lie back to back (gloo's buffer)
                outs = [got[0].new_empty(f) if o is None or not _fits(o, f, got[0]) else o
                        for o, f in zip(into or [None] * len(full), full)]
                torch.split_with_sizes_copy(rows, widths, dim=1, out=[o.view(m, -1) for o in outs])
                return outs
            splits = [piece.split([n[j] for n in numels]) for j, piece in enumerate(got)]
            return [torch.cat([splits[j][i].view(shapes[i][j]) for j in range(m)], dim=dims[i])
                    for i in range(len(routes))]
        return finish
    return begin


def _fits(t: torch.Tensor, shape: tuple, like: torch.Tensor) -> bool:
    """Whether the all-gather's copy-out can write `t` as the result of that shape (contiguous, same kind)."""
    return tuple(t.shape) == tuple(shape) and t.dtype == like.dtype and t.device == like.device and t.is_contiguous()


def _reduce_scatter_bucket(routes, group, op, rank) -> Callable:
    """One reduce-scatter: the chunk for member j holds, back to back, each shard's part for j. The
    chunks are views of one buffer, back to back in group order, so that a backend can reduce-scatter
    the single tensor (gloo's faster form) when they are of one size.

    When every part is an equal share of dim 0 (FSDP's case), the buffer read as [members, piece] holds
    each part as a block of columns: one copy per part (FSDP2's copy-in, `torch._chunk_cat`, without its
    contiguous copies of every transposed gradient held at once: +40-80 MiB on the wide GPT's peak)
    instead of one per part and member."""
    boxes, olds = [], []
    for p in routes:
        step = p.steps[0]
        old = step.src.shard(p.shape, rank)
        olds.append(sizes(old))
        boxes.append([relative(step.dst.shard(p.shape, r), old) for r in group])
    m = len(group)
    lengths = [sum(numel(b[j]) for b in boxes) for j in range(m)]
    total = sum(lengths)
    me = group.index(rank)
    mine = [sizes(b[me]) for b in boxes]
    mine_numels = [numel(b[me]) for b in boxes]
    even = len(set(lengths)) == 1 and all(_even_rows(b, old, m) for b, old in zip(boxes, olds))
    widths = [numel(b[0]) for b in boxes]  # per member, of each part

    def begin(locals_, comm) -> Callable[[], list[torch.Tensor]]:
        flat = locals_[0].new_empty(total)
        if even:  # member j's row of the grid is its chunk; each part a block of columns
            grid, col = flat.view(m, -1), 0
            for t, w in zip(locals_, widths):
                # one tensor made contiguous at a time (torch._chunk_cat would hold all such copies at once)
                grid[:, col:col + w].copy_((t if t.is_contiguous() else t.contiguous()).view(m, w))
                col += w
            chunks = list(flat.split(lengths))
        else:
            chunks = list(flat.split(lengths))
            # a weight's gradient is often a transposed view: made contiguous at once (torch's transpose
            # kernel, one tensor at a time), its pieces are then plain block copies, each straight into place
            at = [0] * m
            for t, b in zip(locals_, boxes):
                whole = t if t.is_contiguous() else t.contiguous()
                for j, chunk in enumerate(chunks):
                    piece = slice_box(whole, b[j])
                    chunk[at[j]:at[j] + piece.numel()].view(piece.shape).copy_(piece)
                    at[j] += piece.numel()
        done = comm.reduce_scatter_start(chunks, group, op)

        def finish(into: Optional[list] = None) -> list[torch.Tensor]:  # `execute_many_start` fills `into`
            return [piece.view(s) for s, piece in zip(mine, done().split(mine_numels))]
        return finish
    return begin


def _even_rows(boxes: list, local: tuple, m: int) -> bool:
    """Whether member j's box is the j-th of m equal, non-empty row ranges of the whole local tensor."""
    if not local or local[0] == 0 or local[0] % m:
        return False
    rows = local[0] // m
    rest = tuple((0, n) for n in local[1:])
    return all(b[0] == (j * rows, rows) and b[1:] == rest for j, b in enumerate(boxes))


_BUCKETS = {"all_gather": _all_gather_bucket, "reduce_scatter": _reduce_scatter_bucket,
            "all_reduce": _all_reduce_bucket}
_STARTED = ("all_gather", "reduce_scatter")  # start now, finish apart; the others run at once


def convert_local(local: torch.Tensor, src: Layout, dst: Layout, shape: Sequence[int],
                  comm: Communicator) -> torch.Tensor:
    """Find the route (cached) and execute one conversion of this rank's shard."""
    return execute(find_route(src, dst, shape, local.dtype), local, comm)


def _axis_step(fn: Callable) -> Callable:
    """1-D steps run on the source placement's axis groups; other ranks keep their (empty) local (None)."""
    def compile_step(step: Step, shape: tuple, rank: int) -> Optional[Callable]:
        if rank not in step.src.placement:
            return None
        return fn(step, shape, rank, step.src.placement.group(rank, step.axis))
    return compile_step


@_axis_step
def _all_gather(step, shape, rank, group):
    d = step.src.sbp[step.axis].dim
    shapes = [step.src.local_shape(shape, r) for r in group]
    return lambda local, comm: _cat(comm.all_gather(local, group, shapes), d)


@_axis_step
def _all_to_all(step, shape, rank, group):
    old, new = step.src.shard(shape, rank), step.dst.shard(shape, rank)
    sends = Tiling.of(sizes(old), [relative(intersect(old, step.dst.shard(shape, r)), old) for r in group])
    recvs = Tiling.of(sizes(new), [relative(intersect(step.src.shard(shape, r), new), new) for r in group])
    pack, unpack = sends.packer(), recvs.unpacker()
    send_splits, recv_splits, new_shape, total = sends.splits, recvs.splits, sizes(new), sum(recvs.splits)

    def receives(g: tuple, j: int) -> list:  # what member j of a group g (any rank's) receives from each
        mine = step.dst.shard(shape, g[j])
        return [numel(intersect(step.src.shard(shape, r), mine)) for r in g]

    def all_to_all(local, comm):
        if _SYMMETRY.classes is not None:  # a symmetric dry run (runtime/symmetry.py): what every member receives
            comm.receives = receives
        send = pack(local, lambda n, dtype: comm.send_buffer(n, dtype, local.device))  # sim: cuda shards, cpu comm
        if unpack is None:  # receive straight into the new shard
            out = local.new_empty(new_shape)
            comm.all_to_all_into(send, send_splits, out.view(-1), recv_splits, group)
            return out
        return unpack(comm.all_to_all_into(send, send_splits, local.new_empty(total), recv_splits, group))
    return all_to_all


def _cat(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that pieces already lying back to back in one buffer become a view of it."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    if _traced(first):  # torch.compile is tracing: no storages to read, and the graph's cat is what runs
        return torch.cat(pieces, dim=dim)
    if all(s == 1 for s in first.shape[:dim]) and all(p.is_contiguous() for p in pieces):
        storage, size = first.untyped_storage().data_ptr(), first.element_size()
        end = first.data_ptr()
        for p in pieces:
            if p.untyped_storage().data_ptr() != storage or p.data_ptr() != end:
                break
            end += p.numel() * size
        else:
            shape = list(first.shape)
            shape[dim] = sum(p.shape[dim] for p in pieces)
            return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
    return torch.cat(pieces, dim=dim)


@_axis_step
def _reduce_scatter(step, shape, rank, group):
    old = step.src.shard(shape, rank)
    chunks = [relative(step.dst.shard(shape, r), old) for r in group]
    op = step.op
    return lambda local, comm: comm.reduce_scatter([slice_box(local, b) for b in chunks], group, op)


@_axis_step
def _all_reduce(step, shape, rank, group):
    op = step.op
    return lambda local, comm: comm.all_reduce(local, group, op)


@_axis_step
def _slice(step, shape, rank, group):
    old = step.src.shard(shape, rank)
    box = relative(step.dst.shard(shape, rank), old)
    cuts = [(d, start, size) for d, ((start, size), (_, full)) in enumerate(zip(box, old)) if size != full]
    if len(cuts) == 1:  # the usual B -> S(d): one basic-indexing slice (faster than narrow)
        (d, start, size), = cuts
        index = slice(start, start + size) if d == 0 else (slice(None),) * d + (slice(start, start + size),)
        return lambda local, comm: local[index]
    return lambda local, comm: slice_box(local, box)


@_axis_step
def _fill(step, shape, rank, group):
    if step.op == "sum" and group.index(rank) != 0:
        return lambda local, comm: torch.zeros_like(local)
    return None  # max/min are idempotent: every rank may keep the value


@_axis_step
def _pad(step, shape, rank, group):
    old, new = step.src.shard(shape, rank), step.dst.shard(shape, rank)
    out_shape, box, op = sizes(new), relative(old, new), step.op

    def pad(local, comm):
        out = local.new_full(out_shape, identity(op, local.dtype))
        slice_box(out, box).copy_(local)
        return out
    return pad


def _exchange(step: Step, shape: tuple, rank: int) -> Optional[Callable]:
    """A point-to-point exchange, with what each call needs worked out: message sizes, which messages
    land in place in the output (a contiguous block of it), and the copies and fills left over."""
    part = step.exchange(rank)
    if part is None:
        return None
    key = _message_key(step, shape)
    inside = rank in step.dst.placement
    regions = part.regions
    send_boxes = part.sends
    recv_numels = tuple((peer, sum(numel(b) for b in boxes)) for peer, boxes in part.recvs)
    bcasts = part.bcasts
    if inside and len(regions) == 1 and regions[0][0] == "copy" and sizes(regions[0][1]) == part.out_shape:
        held = regions[0][2]  # the output is a slice of the input: a view, no copy

        def send_and_slice(local, comm):
            _send_and_receive(local, comm, send_boxes, recv_numels, bcasts, None, key)
            return slice_box(local, held)
        return send_and_slice
    if inside and len(regions) == 1 and regions[0][0] == "recv" and sizes(regions[0][1]) == part.out_shape:
        peer, out_shape = regions[0][2][0], part.out_shape  # the output is one message (a pipeline's activation)

        def receive_whole(local, comm):
            # the received buffer is the output: no output allocated and copied into (a receive posted ahead
            # lands in its own buffer)
            return _send_and_receive(local, comm, send_boxes, recv_numels, bcasts, None, key)[peer].view(out_shape)
        return receive_whole
    if not inside:
        def send_only(local, comm):
            _send_and_receive(local, comm, send_boxes, recv_numels, bcasts, None, key)
            return local.new_empty((0,))
        return send_only
    out_shape = part.out_shape
    meta = torch.empty(out_shape, device="meta")
    in_place = tuple((peer, boxes[0]) for peer, boxes in part.recvs
                     if len(boxes) == 1 and slice_box(meta, boxes[0]).is_contiguous())
    landed = {peer for peer, _ in in_place}
    splits = {peer: [numel(b) for b in boxes] for peer, boxes in part.recvs}
    copies = tuple((box, arg) for kind, box, arg in regions if kind == "copy")
    fills = tuple((box, arg) for kind, box, arg in regions if kind == "fill")
    pieces = tuple((box, arg) for kind, box, arg in regions if kind == "recv" and arg[0] not in landed)

    def exchange(local, comm):
        out = local.new_empty(out_shape)
        into = {peer: slice_box(out, box).view(-1) for peer, box in in_place}
        got = _send_and_receive(local, comm, send_boxes, recv_numels, bcasts, into, key)
        for box, held in copies:
            slice_box(out, box).copy_(slice_box(local, held))
        for box, op in fills:
            slice_box(out, box).fill_(identity(op, local.dtype))
        split = {}
        for box, (peer, i) in pieces:
            if peer not in split:
                msg = got[peer]
                split[peer] = (msg,) if len(splits.get(peer, ())) <= 1 else msg.split(splits[peer])
            slice_box(out, box).copy_(split[peer][i].view(sizes(box)))
        return out
    return exchange


def _message_key(step: Step, shape: tuple) -> int:
    """A number naming this conversion, the same in every process (str hashes are not): messages of
    different conversions never match each other, whatever order two ranks run them in."""
    return zlib.crc32(repr((step.src, step.dst, step.primitive, shape)).encode()) or 1


def _send_and_receive(local, comm, send_boxes, recv_numels, bcasts, into, key=0) -> dict:
    """The exchange's broadcasts, then its sends and receives; what each peer sent (received into `into`'s)."""
    heard = {}
    for group, src, box, n in bcasts:  # every rank runs them in the same (sender) order
        t = slice_box(local, box).reshape(-1) if src == comm.rank else None
        out = comm.broadcast(t, group, src, (n,), local.dtype)
        if src != comm.rank:
            heard[src] = out
    sends = {}
    for peer, boxes in send_boxes:
        parts = [slice_box(local, b).reshape(-1) for b in boxes]
        sends[peer] = parts[0] if len(parts) == 1 else torch.cat(parts)
    if sends or recv_numels:
        heard.update(comm.exchange(sends, {peer: ((n,), local.dtype) for peer, n in recv_numels}, into,
                                   local.device, key))
    return heard


_COMPILE = {"all_gather": _all_gather, "all_to_all": _all_to_all, "reduce_scatter": _reduce_scatter,
        "all_reduce": _all_reduce, "slice": _slice, "fill": _fill, "pad": _pad,
        "send_recv": _exchange, "broadcast": _exchange, "local": _exchange, **_ZIGZAG_COMPILE}
