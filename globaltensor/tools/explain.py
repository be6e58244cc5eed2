"""`gt.explain(fn, world_size)`: the communication report of a program without running it on data.

Planning a big model's parallelism should not need the hardware: the byte counts of every
collective depend only on shapes, dtypes and layouts, never on values. So the program runs on
the simulator with every tensor on the `meta` device (shapes only: no memory, no arithmetic),
the simulator's collectives pass meta tensors (they cost nothing), and `gt.comm_report()`
records what each collective would receive on real ranks. A program that reads values (`.item()`,
printing a loss, data-dependent shapes) cannot run this way; everything else does unchanged.

One exception to "every tensor on meta": inside an optimizer's `step()`, tensors made without a
device are host tensors, as in a real run. torch's optimizers keep their step counter as a host
scalar made on the default device and read it with `.item()` (Adam's `_get_value`); torch 2.13's
Adam names `device="cpu"`, but 2.11's Adam and still 2.13's RAdam, NAdam and Adamax leave it to
the default device, which a dry run's `torch.device("meta")` would make meta. (Adagrad makes its
counter in its constructor, outside any step: it is meta and Adagrad cannot run dry.)
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..tensor import dry_run_devices
from .report import CommReport, comm_report
from ..placement import Placement
from ..runtime import context, symmetry
from ..runtime.comm import Communicator
from ..runtime.sim import SimWorld
from ..runtime.topology import default_for, install

_LOCK = threading.Lock()
_STEP = threading.local()  # per dry-run rank: `open`, the host-device contexts its optimizer steps entered


def _meta_device(device_type: str) -> torch.device:
    return torch.device("meta")


def _step_on_host(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer pre-step hook: on a dry-run rank, the step makes device-less tensors on the host."""
    entered = getattr(_STEP, "open", None)
    if entered is not None:  # None: a thread that is not a dry-run rank
        host = torch.device("cpu")
        host.__enter__()
        entered.append(host)


def _step_done(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer post-step hook: back to meta."""
    entered = getattr(_STEP, "open", None)
    if entered:
        entered.pop().__exit__(None, None, None)


def explain(fn: Callable, world_size: int, args: Sequence = (), timeout: float | None = None) -> list[CommReport]:
    """Run `fn(*args)` on `world_size` simulated ranks with meta tensors inside `gt.comm_report()`;
    returns each rank's report (`print(reports[0])` is rank 0's tree).

    Every tensor the program creates (the model, the batch) is a meta tensor, and placements of any
    device type keep their shards on `meta`, so a 1-billion-parameter configuration needs no memory.
    The bytes are those of a real run with the same shapes (`tests/test_explain.py` compares them).
    """
    if not callable(fn):
        raise TypeError(f"explain(fn): must be callable, got {type(fn).__name__}")

    def reported(*a: Any) -> CommReport:
        with comm_report() as report:
            fn(*a)
        return report
    return dry_run(reported, world_size, args, timeout, name="explain")


def dry_run(fn: Callable, world_size: int, args: Sequence = (), timeout: float | None = None,
            name: str = "dry_run", symmetric: Placement | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` simulated ranks with every tensor on meta (shapes only: no memory,
    no arithmetic; an optimizer's step makes its host scalars on the host); returns each rank's result.
    `gt.explain` is this with a `comm_report()` around `fn`; `gt.auto_plan` measures its candidates so.

    `symmetric`: the mesh (ranks 0..world_size-1) over which the program is one global program: it runs on
    one rank per class of alike ranks (`runtime/symmetry.py`: every rank where a split is uneven, a
    point-to-point message is sent, ...: then on every rank), and a rank's result is its class's. So `fn` must
    read what it received with `CommLog.recv_bytes_of(rank)`, not `recv_bytes`, and return the log."""
    if not callable(fn):
        raise TypeError(f"{name}(fn): must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{name}(world_size): must be a positive int, got {world_size!r}")
    if context.current_or_none() is not None:
        raise RuntimeError(f"{name}: already inside a launched rank; call it from the top level")
    if symmetric is not None and symmetric.size != world_size:
        raise ValueError(f"{name}(symmetric): a mesh of {symmetric.size} ranks for {world_size} ranks")

    def body(comm: Communicator) -> Any:
        comm.device_for = _meta_device  # type: ignore[method-assign]  # every placement's shards on meta
        context.set_thread(comm)
        _STEP.open = []
        try:
            with torch.device("meta"):
                try:
                    return fn(*args)
                finally:  # a step that raised never ran its post hook
                    while _STEP.open:
                        _step_done(None, None, None)
        finally:
            _STEP.open = None
            context.set_thread(None)

    with _LOCK:  # one dry run at a time: the swap and the hooks below are process-wide
        hooks = (register_optimizer_step_pre_hook(_step_on_host), register_optimizer_step_post_hook(_step_done))
        try:
            with dry_run_devices():
                if symmetric is not None:
                    install(default_for("sim"))  # as a simulated world starts
                    try:
                        return symmetry.run(body, symmetric)
                    except symmetry.Asymmetric:
                        pass  # every rank, then
                return SimWorld(world_size, timeout, device="meta").run(body)
        finally:
            for hook in hooks:
                hook.remove()
