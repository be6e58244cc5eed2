"""`gt.launch`: run one function on every rank and return the per-rank results.

`backend="sim"` runs ranks as threads of this process; `"gloo"`/`"nccl"`
spawn one process per rank, as `torchrun` would. Either way an exception on a
rank is re-raised in the caller with its rank and traceback, and the other
ranks are released rather than left hanging.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import context
from .dist import TorchDistCommunicator
from .failure import CollectiveError, RankError, default_timeout, raise_rank_failure
from .topology import Topology
from .sim import SimCommunicator, SimWorld

BACKENDS = ("sim", "gloo", "nccl")


def launch(fn: Callable, world_size: int, backend: str = "sim", args: Sequence = (),
           timeout: float | None = None, ranks_per_node: int | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; returns [result of rank 0, rank 1, ...].

    `ranks_per_node` (the simulator): model ranks k*G .. k*G + G - 1 as node k (`runtime/topology.py`), so the
    planner prices bytes between nodes dearer and `gt.comm_log()` tells them apart; processes on this machine
    are one node (torchrun says how many workers each node has)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"launch(world_size): must be a positive int, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"launch(backend): must be one of {BACKENDS}, got {backend!r}")
    if not callable(fn):
        raise TypeError(f"launch(fn): must be callable, got {type(fn).__name__}")
    if context.current_or_none() is not None:
        raise RuntimeError("launch: already inside a launched rank; call fn directly instead of nesting launch")
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        if multiprocessing.current_process().name.startswith(_RANK_NAME):
            # a rank of ours: the parent reports it once, from the exit code (each rank printing the same
            # traceback buried the one message under world_size + 1 copies)
            raise SystemExit(_UNGUARDED_EXIT)
        raise RuntimeError(_UNGUARDED.format(script=_main_file()))
    timeout = default_timeout() if timeout is None else float(timeout)
    if backend == "sim":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
            warnings.warn(f"gt.launch(backend='sim', world_size={world_size}) under torchrun: each of the "
                          f"{os.environ['WORLD_SIZE']} torchrun processes simulates {world_size} ranks of its own "
                          f"({os.environ['WORLD_SIZE']} x {world_size} ranks in all, none talking to the others). "
                          "Under torchrun call the program directly: "
                          "`program() if 'RANK' in os.environ else gt.launch(program, n)`", stacklevel=2)
        return SimWorld(world_size, timeout, topology=Topology(ranks_per_node)).run(_as_current(fn, tuple(args)))
    if ranks_per_node is not None:
        raise ValueError(f"launch(ranks_per_node={ranks_per_node}): models nodes in the simulator only; processes "
                         "that gt.launch spawns share this machine (run torchrun per node, or set GT_RANKS_PER_NODE)")
    _check_spawnable(fn, tuple(args), backend)
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
            raise ValueError(f"launch(backend='nccl'): needs {world_size} CUDA devices, "
                             f"found {torch.cuda.device_count() if torch.cuda.is_available() else 0}; "
                             "use backend='gloo' on CPU")
    return _launch_processes(fn, world_size, backend, tuple(args), timeout)


_UNGUARDED = ("gt.launch was called while a spawned rank process was starting: spawned processes begin by "
              "importing the script that called gt.launch ({script}), and this script calls gt.launch at import. "
              "Put the call under `if __name__ == \"__main__\":` (multiprocessing's spawn needs that guard)")


_RANK_NAME = "gt-rank"  # a spawned rank's process name; spawn sets it before the child imports the script
_UNGUARDED_EXIT = 86  # a rank's exit code for "the script called gt.launch at import" (see `launch`)


def _main_file() -> str:
    """The script spawned processes import (while one starts, it is being run as `__mp_main__`)."""
    for name in ("__mp_main__", "__main__"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            return path
    return "the main module"


def _check_spawnable(fn: Callable, args: tuple, backend: str) -> None:
    """Spawned processes find `fn` by module and name and receive `args` pickled: say so before spawning.

    A lambda, a nested function or a closure has no importable name, and a function defined in an
    interactive session (stdin, a REPL) lives in a `__main__` the processes cannot import.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - PicklingError, AttributeError, TypeError alike
        raise TypeError(f"launch(fn): backend={backend!r} starts fresh processes, which import fn by its module "
                        f"and name; {name} has none to import ({type(e).__name__}: {e}). A lambda, nested "
                        "function or closure cannot be sent: define fn with `def` at the top level of a module, "
                        "pass what it needs through args=(...) (or a functools.partial of a top-level "
                        "function); backend='sim' runs any callable") from None
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None and not os.path.exists(path):  # `python - <<EOF`: the processes would re-run "<stdin>"
        raise TypeError(f"launch: backend={backend!r} starts processes that first re-run the main script, and "
                        f"this one is {path!r}, not a file; save the program to a file (with "
                        "`if __name__ == \"__main__\":`) or use backend='sim'")
    if getattr(fn, "__module__", None) == "__main__" and not path:
        raise TypeError(f"launch(fn): {name} is defined in an interactive session, which the spawned "
                        f"processes of backend={backend!r} cannot import; put it in a file (a script with "
                        "`if __name__ == \"__main__\":`, or a module) or use backend='sim'")
    try:
        pickle.dumps(args)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"launch(args): backend={backend!r} sends args to each process pickled, and they "
                        f"cannot be ({type(e).__name__}: {e})") from None


def _as_current(fn: Callable, args: tuple) -> Callable[[SimCommunicator], Any]:
    """A simulated rank's body: `fn(*args)` with the rank's communicator bound to its thread."""
    def body(comm: SimCommunicator) -> Any:
        context.set_thread(comm)
        try:
            return fn(*args)
        finally:
            context.set_thread(None)
    return body


def _worker(rank: int, world_size: int, backend: str, init_file: str, fn: Callable, args: tuple,
            timeout: float, results: Any, started: Any) -> None:
    # fn was found and unpickled in this process. Shared memory, not the queue: a process that ends
    # abruptly (os._exit) may take unflushed queue messages with it
    started[rank] = 1
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: ranks sharing a machine must not oversubscribe it
        torch.set_num_threads(1)
    try:
        try:
            comm = TorchDistCommunicator.init(backend, rank, world_size, f"file://{init_file}", timeout)
        except RuntimeError as e:  # a peer that failed (or exited) early closes its connections under us
            raise CollectiveError(f"rank {rank} could not join the {backend} process group: {e}") from e
        comm.watch_collectives(functools.partial(_fail_stuck, rank, results))
        context.set_process(comm)
        out = pickle.dumps(fn(*args))  # plain bytes: shared-memory tensors would die with this process
        comm.finish()
        results.put((rank, True, out, ""))
    except BaseException as e:  # noqa: BLE001 - carried to the caller
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(e)
            pickle.loads(payload)
        except Exception:  # noqa: BLE001
            payload = pickle.dumps(RankError(rank, f"rank {rank} failed: {e!r}"))
        results.put((rank, False, payload, tb))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _death(rank: int, code: int, started: bool, fn: Callable) -> str:
    """Why a rank's process ended without a result: while running fn, or before it got to fn.

    Exit code 0 is no success here: a rank that succeeds sends its result first. Without one the
    caller would wait for it forever."""
    name = getattr(fn, '__qualname__', 'fn')
    if code == _UNGUARDED_EXIT and not started:
        return (f"rank {rank} exited before running {name}: a spawned process starts by importing the script "
                f"that called gt.launch ({_main_file()}), and this script calls gt.launch at import. Put the "
                "call under `if __name__ == \"__main__\":` (multiprocessing's spawn needs that guard)")
    if code == 0:
        if started:
            return (f"rank {rank} exited with exit code 0 without a result while running {name}: something "
                    "ended its process without returning (os._exit, or a library exiting the interpreter)")
        return (f"rank {rank} exited with exit code 0 without a result before running {name}: a spawned process "
                f"starts by importing the script that called gt.launch ({_main_file()}), and that import ended "
                "it (sys.exit() or SystemExit at the script's top level, argparse's --help). Put the script's "
                "top-level code under `if __name__ == \"__main__\":`")
    if started:
        return f"rank {rank} died with exit code {code} while running {name} (killed, or the interpreter aborted)"
    return (f"rank {rank} died with exit code {code} before running {name}: a spawned "
            f"process starts by importing the script that called gt.launch ({_main_file()}) and unpickling fn, "
            "and that failed (its traceback is printed above). Most often the script calls gt.launch at import: "
            "put the call under `if __name__ == \"__main__\":`")


def _fail_stuck(rank: int, results: Any, err: BaseException) -> None:
    """A mismatched collective seen by the watcher thread: report it as this rank's error and end the
    process (its main thread waits inside gloo and cannot be interrupted)."""
    results.put((rank, False, pickle.dumps(err), ""))
    results.close()
    results.join_thread()  # flushed before the process ends
    os._exit(1)


def _launch_processes(fn: Callable, world_size: int, backend: str, args: tuple, timeout: float) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="gt-launch-")
    os.close(fd)
    os.unlink(init_file)  # FileStore creates it; a stale file would confuse rendezvous
    started = ctx.Array("b", world_size, lock=False)  # set by each rank once fn is unpickled
    procs = [ctx.Process(target=_worker, args=(r, world_size, backend, init_file, fn, args, timeout, results,
                                               started), name=f"{_RANK_NAME}{r}", daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, tuple[BaseException, str]] = {}
    gone: set[int] = set()  # ended without a result so far: lost unless the queue still holds one
    grace_until: float | None = None
    try:
        while len(out) + len(errors) < world_size:
            if grace_until is not None and time.monotonic() > grace_until:
                break  # the others are stuck in collectives with the failed rank: stop waiting
            try:
                rank, ok, value, tb = results.get(timeout=0.2)
            except queue_mod.Empty:
                # A process flushes what it put on the queue before it ends, so one seen ended before an
                # empty read has nothing left to say: only then is it lost (whatever its exit code; one
                # that ended with 0 and no result was once waited for forever).
                for r in sorted(gone):
                    if r not in out and r not in errors:
                        errors[r] = (RankError(r, _death(r, procs[r].exitcode, bool(started[r]), fn)), "")
                        grace_until = grace_until or time.monotonic() + 2.0
                gone = {r for r, p in enumerate(procs) if r not in out and r not in errors and p.exitcode is not None}
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = (pickle.loads(value), tb)
                grace_until = grace_until or time.monotonic() + 2.0
    finally:
        for p in procs:
            if p.is_alive() and errors:
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        results.close()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise_rank_failure(errors)
    return [out[r] for r in range(world_size)]
