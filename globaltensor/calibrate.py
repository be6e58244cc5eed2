"""`gt.calibrate(mesh)`: the link model measured on the running communicator (`runtime/topology.py`).

Per mesh axis, every group of the axis times all-gathers and all-reduces of two sizes at once, and a
straight line t = alpha + beta * bytes (bytes a rank receives, by the planner's convention: an all-gather
(n-1)/n of the whole, an all-reduce 2(n-1)/n) is fitted through the slowest rank's medians: least squares
over the four points. Axes whose groups stay inside nodes make the inside link (their fits averaged), those
spanning nodes the across link; a class the mesh has no axis of keeps the model in force's link. A matmul
times the compute rate. Every rank fits the same numbers (the slowest rank's times, all-reduced), so every
rank installs the same model and the ranks keep deciding alike.

On the simulator (one process, ranks as threads) the times are the simulator's own: a collective there
is a rendezvous of threads and a copy, not a network; the fit says how the simulator behaves, not a
cluster, and its `source` says so.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .placement import Placement
from .runtime import context
from .runtime.topology import Link, LinkModel, in_force, install


@dataclass(frozen=True)
class Calibration:
    """What `gt.calibrate` measured: per mesh axis its link class and fitted `Link`, the samples
    ((collective, bytes a rank receives, seconds) per axis), and the `model` made of them."""
    axes: tuple
    samples: tuple
    model: LinkModel

    def __str__(self) -> str:
        lines = [f"link model: {self.model.source}"]
        for a, (kind, link) in enumerate(self.axes):
            lines.append(f"  axis {a} ({kind}): alpha {link.alpha * 1e6:.1f} us, beta {link.beta * 1e9:.3f} ns/B "
                         f"({1 / link.beta / 1e9:.2f} GB/s)")
        flop = self.model.flop
        lines.append(f"  compute: {1 / flop / 1e9:.1f} GFLOP/s" if flop else "  compute: not weighed")
        return "\n".join(lines)


def _fit(points: list) -> Link:
    """Least squares t = alpha + beta * b through (b, t) points; alpha >= 0, beta > 0."""
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((b - mb) ** 2 for b, _ in points)
    beta = sum((b - mb) * (t - mt) for b, t in points) / var if var else 0.0
    beta = max(beta, 1e-15)
    return Link(max(mt - beta * mb, 0.0), beta)


def calibrate(mesh: Placement, sizes: tuple = (256, 1 << 20), repeats: int = 5, install_model: bool = True,
              flops: bool = True) -> Calibration:
    """Time all-gathers and all-reduces of `sizes` bytes (each rank's piece) per mesh axis of `mesh` on the
    running communicator, fit alpha and beta per axis, and (`install_model`) put the model in force for the
    job's decisions (caches of decisions and routes are cleared). Every rank of `mesh` calls it (it runs
    collectives); ranks outside the mesh must not. `flops`: also time a matmul for the compute rate."""
    if not isinstance(mesh, Placement):
        raise TypeError(f"gt.calibrate(mesh): expected a gt.placement, got {type(mesh).__name__}")
    if len(sizes) < 2 or len(set(sizes)) < 2 or min(sizes) < 4:
        raise ValueError(f"gt.calibrate(sizes): at least two different sizes of >= 4 bytes, got {sizes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"gt.calibrate(repeats): a positive int, got {repeats!r}")
    comm = context.current()
    if comm.rank not in mesh.flat_ranks:
        raise ValueError(f"gt.calibrate: rank {comm.rank} is not in the mesh {mesh}; only its ranks call it")
    device = comm.device_for(mesh.device_type)
    everyone = tuple(mesh.flat_ranks)
    measured = []  # per axis: [(kind, bytes received, seconds on this rank)]
    for axis in range(mesh.ndim):
        group = tuple(mesh.group(comm.rank, axis))
        n = len(group)
        rows = []
        for size in sizes:
            piece = torch.ones(max(size // 4, 1), dtype=torch.float32, device=device)
            for kind in ("all_gather", "all_reduce"):
                run = (lambda: comm.all_gather(piece, group)) if kind == "all_gather" else \
                    (lambda: comm.all_reduce(piece.clone(), group))
                run()  # warm: the group's first collective sets it up
                times = []
                for _ in range(repeats):
                    comm.barrier(everyone)
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                nbytes = piece.numel() * 4
                recv = (n - 1) * nbytes if kind == "all_gather" else 2 * (n - 1) * nbytes / n
                rows.append((kind, recv, statistics.median(times)))
        measured.append(rows)
    flop = in_force().flop
    if flops:
        a = torch.ones(256, 256, dtype=torch.float32, device=device)
        a @ a
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ a
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        flop_here = statistics.median(times) / (2 * 256 ** 3)
    # every rank fits the slowest rank's times: one model on every rank
    flat = torch.tensor([t for rows in measured for _, _, t in rows] + ([flop_here] if flops else []),
                        dtype=torch.float64, device=device)
    flat = comm.all_reduce(flat, everyone, "max").cpu().tolist()
    if flops:
        flop = flat.pop()
    kinds = mesh.axis_kind
    axes, samples, k = [], [], 0
    for axis, rows in enumerate(measured):
        points = []
        for kind, recv, _ in rows:
            points.append((recv, flat[k]))
            k += 1
        samples.append(tuple((kind, recv, t) for (kind, recv, _), (_, t) in zip(rows, points)))
        axes.append((kinds[axis], _fit([p for p in points if p[0] > 0]) if any(p[0] for p in points) else
                     in_force().link(kinds[axis])))
    old = in_force()

    def merged(kind: str) -> Link:
        links = [link for c, link in axes if c == kind]
        if not links:
            return old.link(kind)
        return Link(sum(x.alpha for x in links) / len(links), sum(x.beta for x in links) / len(links))
    backend = getattr(comm, "backend", "sim")
    where = ("the simulator (ranks as threads of one process: these are the simulator's times, not a network's)"
             if backend == "sim" else f"torch.distributed ({backend})")
    model = LinkModel(merged("inside"), merged("across"), flop,
                      f"gt.calibrate on {where}, mesh {mesh.shape}, sizes {tuple(sizes)} B")
    if install_model:
        install(model)
    return Calibration(tuple(axes), tuple(samples), model)


def link_model(model: LinkModel | None = None) -> LinkModel:
    """The link model in force (`runtime/topology.py`); with `model`, put it in force instead (every rank the
    same one) and return the previous one."""
    return in_force() if model is None else install(model)
