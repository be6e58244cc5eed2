"""Distributed checkpoints through torch.distributed.checkpoint (DCP), resharded on load.

GlobalTensors implement DCP's checkpointable protocol (`chunks.py`), so under torchrun or
`gt.launch(..., backend="gloo")` plain `dcp.save(state_dict, checkpoint_id=path)` and
`dcp.load(state_dict, checkpoint_id=path)` work unchanged: each element is written once, and a
load reads only the saved chunks overlapping each rank's shard in the *destination* layout,
whatever plan, mesh or world size saved it (a plain single-device module included).

The simulator has no torch.distributed process group (its ranks are threads of one process),
so DCP runs as a world of one on every rank thread. `SavePlanner` and `FileSystemWriter` then
do what DCP's coordinator would, over our communicator: gather every rank's plan (the metadata
names all chunks), give each rank its own file prefix, and let rank 0 write `.metadata` once
every rank has written its data. Under a real process group they are DCP's defaults. Loading
needs no coordination at all. `save`/`load` below pick the right arguments on either backend.

What is unpickled on load: DCP's `FileSystemReader` reads `.metadata` with plain `pickle`
(DCP's own dataclasses), tensors with `torch.load(weights_only=True)`, and non-tensor values
with `torch.load(weights_only=False)` in `DefaultLoadPlanner.load_bytes`. Our part of a
checkpoint is tensors only (RNG states, the step and the data position are encoded as tensors; layouts are not
saved at all: a chunk is offsets and sizes), and `load` uses `LoadPlanner` (non-tensor values
with `weights_only=True`) and `FileSystemReader` (`.metadata` through an unpickler that accepts
DCP's metadata classes and nothing else), so loading never runs arbitrary pickled code.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import struct
import warnings
from concurrent.futures import Future
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from . import chunks
from .layout import Layout
from .placement import placement
from .runtime import context
from .runtime.comm import Communicator
from .sbp import split
from .tensor import GlobalTensor

# DCP warns on every call without a process group; on the simulator that is by design
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

METADATA = ".metadata"  # the file DCP's FileSystemWriter writes last; a directory without it is no checkpoint


def _own_coordination() -> Communicator | None:
    """Our communicator where DCP has no process group but the world has several ranks (the
    simulator); None where DCP coordinates itself (torch.distributed initialised, or one rank)."""
    if dist.is_available() and dist.is_initialized():
        return None
    comm = context.current()
    return comm if comm.world_size > 1 else None


def _world(comm: Communicator) -> tuple[int, ...]:
    return tuple(range(comm.world_size))


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; on the simulator its global step sees every rank's plan.

    With no process group DCP hands `create_global_plan` this rank's plan alone, on every
    rank (each believes it is the coordinator), so every rank gathers all plans over our
    communicator, plans globally (the same result everywhere) and keeps its own part.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._comm = context.current()  # the rank that made the planner: async_save's thread is none

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        if _own_coordination() is not None and context.current() is not self._comm:
            raise RuntimeError("dcp.async_save on the simulator: the save would run in a thread that is no "
                               "simulated rank; use globaltensor.checkpoint.save (synchronous there)")
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        with chunks.coordinated():
            return super().create_local_plan()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], dcp_metadata.Metadata]:
        comm = _own_coordination()
        if comm is None:
            return super().create_global_plan(all_plans)
        (mine,) = all_plans
        plans, md = super().create_global_plan(comm.all_gather_object(mine, _world(comm)))
        self.global_plan = plans
        return [plans[comm.rank]], md


class FileSystemWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter; on the simulator each rank writes its own files, rank 0 the metadata.

    Saving over an existing checkpoint first removes its `.metadata` (before any rank writes data:
    the other ranks write only after the plans are gathered), so an interrupted overwrite leaves a
    directory that is no checkpoint rather than old metadata over half-new files.
    """

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        comm = _own_coordination()
        self._first = comm.rank == 0 if comm is not None else is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)  # DCP's overwrite check and warning
        stale = self._get_metadata_path()
        if self._first and self.use_collectives and self.fs.exists(stale):
            self.fs.rm_file(stale)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        comm = _own_coordination()
        if comm is None:
            return super().prepare_global_plan(plans)
        (mine,) = plans
        placed = [SavePlan([])] * comm.world_size
        placed[comm.rank] = mine
        return [super().prepare_global_plan(placed)[comm.rank]]  # the file prefix of this rank

    def finish(self, metadata: dcp_metadata.Metadata, results: list) -> None:
        comm = _own_coordination()
        if comm is None:
            return super().finish(metadata, results)
        (mine,) = results
        everyone = comm.all_gather_object(mine, _world(comm))
        if comm.rank == 0:
            super().finish(metadata, everyone)
        comm.barrier()  # no rank reads the checkpoint before its metadata is there


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# What a DCP `.metadata` pickle may name: DCP's metadata dataclasses and the torch values in them.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in
    ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
     "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("builtins", "set"), ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
     ("torch.distributed.checkpoint.planner", "WriteItemType"), ("torch.distributed.checkpoint.planner",
                                                                   "LoadItemType")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    (torch.dtype, torch.layout))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is no part of DCP's "
                                     "metadata; refusing to unpickle it")


class FileSystemReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, unpickling `.metadata` with DCP's metadata classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# -- one call on either backend -------------------------------------------------------------

def save(state_dict: dict[str, Any], path: str | os.PathLike, *, async_save: bool = False) -> Any:
    """`dcp.save` (or `dcp.async_save`) of `state_dict` into the directory `path`, on any backend.

    Returns DCP's metadata (keys, shapes, chunks; where each chunk went, `storage_data`, is only
    certain in the written file, `read_metadata(path)`: torch 2.11's writer fills it in on a copy),
    or with `async_save` a Future: wait on it (`.result()`) before the next save and before exiting.
    Under a process group the upload runs in DCP's background thread on a gloo group of its own
    (`dist.new_group`, made once, on every rank), so its collectives never interleave with the
    training's on the default group; staging copies the state first, so training may go on and
    change the parameters at once. The simulator saves synchronously (DCP's background thread
    would be no simulated rank) and returns a done Future.
    """
    path = os.fspath(path)
    kwargs: dict[str, Any] = dict(checkpoint_id=path, planner=SavePlanner(), storage_writer=FileSystemWriter(path))
    under_dist = dist.is_available() and dist.is_initialized()
    if async_save and under_dist:
        return dcp.async_save(state_dict, process_group=_async_group(), **kwargs)
    with _unwrapped():
        md = dcp.save(state_dict, no_dist=not under_dist, **kwargs)
    if not async_save:
        return md
    done: Future = Future()
    done.set_result(md)
    return done


_ASYNC_GROUP: Any = None


def _async_group() -> Any:
    global _ASYNC_GROUP
    if _ASYNC_GROUP is None:
        _ASYNC_GROUP = dist.new_group(backend="gloo")
    return _ASYNC_GROUP


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, strict: bool = True) -> dict[str, Any]:
    """`dcp.load` into `state_dict` in place (each value in its own, destination layout); returns it.

    Checks first, on this rank and before anything is read, that `path` is a checkpoint and
    that every key of `state_dict` is in it with the same global shape (`strict=False` skips
    missing keys), raising an error that names the key or the path.
    """
    path = os.fspath(path)
    _check_against(state_dict, read_metadata(path).state_dict_metadata, path, strict)
    with _unwrapped():
        dcp.load(state_dict, checkpoint_id=path, storage_reader=FileSystemReader(path),
                 planner=LoadPlanner(allow_partial_load=not strict),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    return state_dict


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP raises a `CheckpointException`, a BaseException that `except Exception` misses, holding
    each failed rank's error; re-raise the lowest rank's error itself (DCP's report chained)."""
    try:
        yield
    except CheckpointException as e:
        errors = [exc for _, (exc, _) in sorted(e.failures.items()) if isinstance(exc, Exception)]
        if not errors:
            raise
        raise errors[0] from e


def read_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """The checkpoint's metadata (keys, global shapes, chunks), read safely; a clear error where
    `path` is not a checkpoint."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, METADATA)):
        what = "does not exist" if not os.path.exists(path) else f"has no {METADATA} file"
        raise FileNotFoundError(f"load: {path!r} is not a torch.distributed.checkpoint directory: it {what} "
                                "(an interrupted save never writes it)")
    return FileSystemReader(path).read_metadata()


def _check_against(state_dict: dict[str, Any], saved: dict[str, Any], path: str, strict: bool) -> None:
    for key, value in flatten_state_dict(state_dict)[0].items():  # DCP's own keys
        md = saved.get(key)
        if md is None:
            if strict:
                near = sorted(saved)[:8]
                raise KeyError(f"load: key {key!r} is not in the checkpoint {path!r} (it holds {len(saved)} keys, "
                               f"e.g. {near}); pass strict=False to leave it as it is")
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(md, dcp_metadata.TensorStorageMetadata):
                raise ValueError(f"load: key {key!r} is a tensor here but not in the checkpoint {path!r}")
            if tuple(md.size) != tuple(value.shape):
                raise ValueError(f"load: key {key!r} has shape {tuple(value.shape)} here but {tuple(md.size)} in the "
                                 f"checkpoint {path!r}")


def latest(root: str | os.PathLike) -> str | None:
    """The last complete checkpoint under `root` (subdirectories sorted by name, with `.metadata`)."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, METADATA)))
    return os.path.join(root, done[-1]) if done else None


# -- a training run: model, optimizer, step and RNG ------------------------------------------

def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 0,
                   data: Any = None) -> dict[str, Any]:
    """What resuming needs, as DCP state: torch's `get_state_dict` of model and optimizer
    (parameter-name keys; AdamW's exp_avg/exp_avg_sq keep their parameter's layout, so they are
    saved and resharded as the parameter is), the step, this rank's RNG states and, with `data`
    (a `gt.data.Batches`, or anything whose `state_dict()` is a dict of ints), the data order's
    position, all tensors.

    An optimizer that has not stepped gets its state made by `get_state_dict` (one step at
    learning rate 0 on zero gradients, which leaves AdamW's parameters bitwise as they were),
    so a fresh run has something to load into.
    """
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "step": torch.tensor(step, dtype=torch.int64), "rng": rng_state()}
    if data is not None:  # one value for every rank, as the step: the position is global, not a rank's
        state["data"] = {k: torch.tensor(int(v), dtype=torch.int64) for k, v in data.state_dict().items()}
    return state


def save_training(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
                  data: Any = None, async_save: bool = False) -> Any:
    """Save `training_state` into `path` (see `save` for `async_save`)."""
    return save(training_state(model, optimizer, step, data), path, async_save=async_save)


def load_training(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  data: Any = None) -> int:
    """Load what `save_training` wrote into `model` and `optimizer`, each in its own layout, restore
    this rank's RNG states and `data`'s position (`Batches.load_state_dict`), and return the step
    to continue from.

    Model, optimizer and data position reshard freely (a batch's rows are cut anew for this world);
    the RNG states are per rank, so they are restored only on the world size that saved them
    (elsewhere a warning says that they were not).
    """
    state = training_state(model, optimizer, data=data)
    md = read_metadata(path).state_dict_metadata
    live = flatten_state_dict(state)[0]
    extra = sorted(k for k in md if k.startswith(("model.", "optim.state.")) and k not in live)
    if extra:  # DCP loads a subset silently; a training state must be whole
        raise ValueError(f"load_training: {os.fspath(path)!r} holds {len(extra)} keys that this model and optimizer "
                         f"lack, e.g. {extra[:4]} (another model, or an optimizer with gradients but no state yet: "
                         "zero_grad(set_to_none=True) before loading)")
    if data is not None and not any(k.startswith("data.") for k in md):
        raise ValueError(f"load_training(data): {os.fspath(path)!r} holds no data position (saved without "
                         "save_training(..., data=)); resuming would restart the data order")
    saved = md.get("rng.torch")
    if saved is not None and tuple(saved.size) != tuple(state["rng"]["torch"].shape):
        warnings.warn(f"load_training: {os.fspath(path)!r} was saved by {saved.size[0]} ranks, this world has "
                      f"{state['rng']['torch'].shape[0]}: RNG states not restored", stacklevel=2)
        del state["rng"]
    load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "rng" in state:
        set_rng_state(state["rng"])
    if data is not None:
        data.load_state_dict({k: int(v) for k, v in state["data"].items()})
    return int(state["step"])


def rng_state() -> dict[str, GlobalTensor]:
    """This process's (or simulated rank's) torch, numpy and `random` states as GlobalTensors.

    One row per rank (Split(0) over every rank of the world), so each rank gets its own back:
    resuming needs the same world size, and a mismatch is a shape error naming the key.
    """
    comm = context.current()
    world = placement("cpu", list(range(comm.world_size)))
    rows = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": _python_state()}
    return {k: GlobalTensor(v[None].clone(), _split0(world), (comm.world_size, v.numel())) for k, v in rows.items()}


def set_rng_state(state: dict[str, GlobalTensor]) -> None:
    """Restore what `rng_state` saved (after loading it)."""
    torch.set_rng_state(state["torch"].to_local()[0].to(torch.uint8))
    _set_numpy_state(state["numpy"].to_local()[0])
    _set_python_state(state["python"].to_local()[0])


def _split0(world: Any) -> Layout:
    return Layout(world, (split(0),))


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_f64(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _numpy_state() -> torch.Tensor:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    assert name == "MT19937"
    return torch.tensor([*keys.tolist(), pos, has_gauss, _f64_bits(gauss)], dtype=torch.int64)


def _set_numpy_state(t: torch.Tensor) -> None:
    v = t.tolist()
    np.random.set_state(("MT19937", np.array(v[:624], dtype=np.uint32), v[624], v[625], _bits_f64(v[626])))


def _python_state() -> torch.Tensor:
    version, internal, gauss = random.getstate()
    return torch.tensor([version, *internal, gauss is not None, _f64_bits(gauss or 0.0)], dtype=torch.int64)


def _set_python_state(t: torch.Tensor) -> None:
    v = t.tolist()
    random.setstate((v[0], tuple(v[1:-2]), _bits_f64(v[-1]) if v[-2] else None))


__all__ = ["SavePlanner", "FileSystemWriter", "LoadPlanner", "FileSystemReader", "save", "load", "read_metadata", "latest",
           "training_state", "save_training", "load_training", "rng_state", "set_rng_state", "METADATA"]
