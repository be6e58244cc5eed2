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
checkpoint is tensors only (RNG states and the step are encoded as tensors; layouts are not
saved at all: a chunk is offsets and sizes), and `load` uses `LoadPlanner` (non-tensor values
with `weights_only=True`) and `FileSystemReader` (`.metadata` through an unpickler that accepts
DCP's metadata classes and nothing else), so loading never runs arbitrary pickled code.
"""
from __future__ import annotations

import io
import os
import pickle
import random
import struct
from concurrent.futures import Future
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from . import chunks
from .layout import Layout
from .placement import placement
from .runtime import context
from .runtime.comm import Communicator
from .sbp import split
from .tensor import GlobalTensor

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

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        if _own_coordination() is not None and context.current() is not self._comm:
            raise RuntimeError("dcp.async_save on the simulator: the save would run in a thread that is no "
                               "simulated rank; use globaltensor.checkpoint.save (synchronous there)")
        super().set_up_planner(*args, **kwargs)

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
    """DCP's FileSystemWriter; on the simulator each rank writes its own files, rank 0 the metadata."""

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

def save(state_dict: dict[str, Any], path: str | os.PathLike, *, async_save: bool = False,
         process_group: Any = None) -> Any:
    """`dcp.save` (or `dcp.async_save`) of `state_dict` into the directory `path`, on any backend.

    Returns DCP's metadata, or with `async_save` a Future (DCP's, under a process group: wait
    on it before the next save and before exiting). The simulator saves synchronously (DCP's
    background thread would be no simulated rank) and returns a finished Future.
    """
    path = os.fspath(path)
    kwargs = dict(checkpoint_id=path, planner=SavePlanner(), storage_writer=FileSystemWriter(path))
    if _own_coordination() is not None or not (dist.is_available() and dist.is_initialized()):
        kwargs["no_dist"] = True
    if async_save and "no_dist" not in kwargs:
        return dcp.async_save(state_dict, process_group=process_group, **kwargs)
    md = dcp.save(state_dict, process_group=process_group, **kwargs)
    if not async_save:
        return md
    done: Future = Future()
    done.set_result(md)
    return done


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, strict: bool = True) -> dict[str, Any]:
    """`dcp.load` into `state_dict` in place (each value in its own, destination layout); returns it.

    Checks first, on this rank and before anything is read, that `path` is a checkpoint and
    that every key of `state_dict` is in it with the same global shape (`strict=False` skips
    missing keys), raising an error that names the key or the path.
    """
    path = os.fspath(path)
    reader = FileSystemReader(path)
    if not os.path.isfile(os.path.join(path, METADATA)):
        what = "does not exist" if not os.path.exists(path) else f"has no {METADATA} file"
        raise FileNotFoundError(f"load: {path!r} is not a torch.distributed.checkpoint directory: it {what} "
                                "(an interrupted save never writes it)")
    _check_against(state_dict, reader.read_metadata().state_dict_metadata, path, strict)
    no_dist = _own_coordination() is not None or not (dist.is_available() and dist.is_initialized())
    dcp.load(state_dict, checkpoint_id=path, storage_reader=reader,
             planner=LoadPlanner(allow_partial_load=not strict), no_dist=no_dist)
    return state_dict


def _flat_items(state_dict: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in state_dict.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flat_items(v, f"{key}.")
        elif isinstance(v, (list, tuple)) and v and all(isinstance(e, (torch.Tensor, dict)) for e in v):
            yield from _flat_items({str(i): e for i, e in enumerate(v)}, f"{key}.")
        else:
            yield key, v


def _check_against(state_dict: dict[str, Any], saved: dict[str, Any], path: str, strict: bool) -> None:
    for key, value in _flat_items(state_dict):
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


# -- optimizer state and RNG, as tensors ----------------------------------------------------

def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (as torch's `get_state_dict`), for DCP.

    Each state tensor keeps its parameter's layout, so it is saved chunk by chunk and resharded
    on load like the parameter itself. An optimizer that has not stepped yet gets its state made
    first (zeros, step 0: what its first step would start from), so that there is something to
    load into.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    _init_state(optimizer)
    state: dict[str, Any] = {}
    for p, s in optimizer.state.items():
        if id(p) not in names:
            raise ValueError("optimizer_state_dict: the optimizer holds a parameter that is not the model's")
        state[names[id(p)]] = dict(s)
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": _groups_as_tensors(groups)}


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state_dict: dict[str, Any]) -> None:
    """Put `optimizer_state_dict`'s (loaded) result back into the optimizer."""
    params = dict(model.named_parameters())
    for name, s in state_dict["state"].items():
        target = optimizer.state[params[name]]
        for k, v in s.items():
            if isinstance(target.get(k), torch.Tensor) and target[k] is not v:
                target[k].copy_(v)
            else:
                target[k] = v
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        for k, v in saved.items():
            if k != "params":
                group[k] = _from_tensor(v, group.get(k))


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the state a fresh optimizer's first step would make, without stepping: zeroed grads
    and a zero learning rate would still move AdamW's weights through weight decay rounding."""
    if all(p in optimizer.state for g in optimizer.param_groups for p in g["params"]):
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p not in optimizer.state and p.requires_grad:
                if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                    s = optimizer.state[p]
                    s["step"] = torch.tensor(0.0, dtype=torch.float32)
                    s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if g.get("amsgrad"):
                        s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                else:
                    raise NotImplementedError(f"optimizer_state_dict: {type(optimizer).__name__} has no state yet; "
                                              "take a step first (only Adam/AdamW state is made here)")


def _groups_as_tensors(groups: list[dict]) -> list[dict]:
    """Hyper-parameters as 0-d tensors where they are numbers: a checkpoint of tensors only."""
    out = []
    for g in groups:
        out.append({k: _as_tensor(v) for k, v in g.items() if k != "params" and _as_tensor(v) is not None})
    return out


def _as_tensor(v: Any) -> torch.Tensor | None:
    if isinstance(v, bool):
        return torch.tensor(v)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    if isinstance(v, tuple) and all(isinstance(e, float) for e in v):
        return torch.tensor(v, dtype=torch.float64)
    return None  # None values, strings: not state (foreach, fused, differentiable flags are settings)


def _from_tensor(v: Any, like: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if isinstance(like, tuple):
        return tuple(v.tolist())
    if isinstance(like, torch.Tensor):
        return v
    return v.item()


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


__all__ = ["SavePlanner", "FileSystemWriter", "LoadPlanner", "FileSystemReader", "save", "load", "latest",
           "optimizer_state_dict", "load_optimizer_state_dict", "rng_state", "set_rng_state", "METADATA"]
