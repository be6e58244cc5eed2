"""Global batches of a dataset whose order survives a restart, on any number of ranks.

What a job loses when a rank dies is its place in the data (torchtitan #811, #850): a resumed run that
starts its sampler over trains on batches it has seen and never on the rest, and its losses leave the
uninterrupted run's. So the order here is a function of the seed, the epoch and the dataset's length
alone: global batch b of epoch e is the same rows whatever the world size, each rank reads only the rows
its shard of the batch holds (`Layout.shard`), and the position (epoch, batch) is the whole state,
saved with the checkpoint (`checkpoint.save_training(..., data=batches)`). A job resumed on 2 ranks from
4 ranks' checkpoint reads the same next batch, cut in two instead of four.

The state counts the batches handed to the training loop, not those a `DataLoader`'s workers have
prefetched, so a checkpoint taken between steps resumes at the next unseen batch (torchdata's
`StatefulDataLoader` counts the same way).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, default_collate

from .api import from_local
from .layout import Layout, normalize_sbp
from .placement import Placement
from .runtime import context
from .sbp import Broadcast, SbpLike, Split

__all__ = ["Batches", "batch_indices"]

_KEYS = ("epoch", "batch", "seed", "shuffle", "batch_size", "dataset_len")


def batch_indices(n: int, batch_size: int, seed: int, epoch: int, batch: int, shuffle: bool = True) -> torch.Tensor:
    """The rows of global batch `batch` of `epoch` over a dataset of `n` rows: a function of these alone,
    so one device, any mesh and a resumed job read the same rows (`Batches`' order)."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed((seed * 0x9E3779B1 + epoch) % 2 ** 63))
    else:
        order = torch.arange(n)
    return order[batch * batch_size:(batch + 1) * batch_size]


class Batches:
    """A map-style `dataset` in global batches of `batch_size` rows, laid out as `sbp` on `placement`
    (dim 0, the batch, split over the data axes; whole on the others), shuffled per epoch by `seed`.

    Iterating yields the rest of the current epoch (each batch a pytree of GlobalTensors, as
    `default_collate` or `collate_fn` shapes a rank's samples); the epoch ends after `len(dataset) //
    batch_size` batches (a last partial batch is dropped, so every batch has one global shape) and the
    next iteration starts the next epoch. `num_workers` > 0 loads through torch's `DataLoader`.
    """

    def __init__(self, dataset: Any, batch_size: int, placement: Placement, sbp: SbpLike, *, seed: int = 0,
                 shuffle: bool = True, collate_fn: Optional[Callable] = None, num_workers: int = 0) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"Batches(batch_size): expected a positive int, got {batch_size!r}")
        if len(dataset) < batch_size:
            raise ValueError(f"Batches(batch_size): {batch_size} rows a batch, but the dataset has {len(dataset)}: "
                             "not one whole batch (lower batch_size)")
        layout = Layout(placement, normalize_sbp(sbp, placement.ndim, "Batches(sbp)"))
        bad = [s for s in layout.sbp if not (isinstance(s, Broadcast) or isinstance(s, Split) and s.dim == 0)]
        if bad:
            raise ValueError(f"Batches(sbp): a batch is split on its dim 0 (the rows) or whole, per mesh axis; got "
                             f"{layout.sbp} (a layout inside the model is the model's to choose: box the batch "
                             "after loading)")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"Batches(seed): expected a non-negative int, got {seed!r}")
        self.dataset, self.batch_size, self.layout, self.seed = dataset, batch_size, layout, seed
        self.shuffle, self.num_workers = shuffle, num_workers
        self.collate_fn = collate_fn or default_collate
        self.per_epoch = len(dataset) // batch_size
        self.epoch = self.batch = 0

    def indices(self, epoch: int, batch: int) -> torch.Tensor:
        """The dataset rows of global batch `batch` of `epoch`: the same on every rank and world size."""
        return batch_indices(len(self.dataset), self.batch_size, self.seed, epoch, batch, self.shuffle)

    def _mine(self, epoch: int, batch: int, rank: int) -> list[int]:
        box = self.layout.shard((self.batch_size,), rank)
        if box is None:
            raise ValueError(f"Batches: rank {rank} is not in the placement {self.layout.placement}")
        (start, size), = box
        return self.indices(epoch, batch)[start:start + size].tolist()

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self) -> Iterator[Any]:
        rank, epoch, first = context.current().rank, self.epoch, self.batch
        if self.num_workers:
            if self.batch_size < self.layout.placement.size:
                raise ValueError(f"Batches(num_workers): a batch of {self.batch_size} rows leaves some of the "
                                 f"{self.layout.placement.size} ranks no rows, which a DataLoader cannot load "
                                 "(num_workers=0 does)")
            rows = DataLoader(self.dataset, batch_sampler=[self._mine(epoch, b, rank)
                                                           for b in range(first, self.per_epoch)],
                              collate_fn=self.collate_fn, num_workers=self.num_workers)
        else:
            rows = (self._collate(epoch, b, rank) for b in range(first, self.per_epoch))
        at = first
        for local in rows:
            at += 1
            self.batch = at  # handed out: a checkpoint taken now resumes after it
            yield pytree.tree_map_only(torch.Tensor, self._global, local)
            if (self.epoch, self.batch) != (epoch, at):
                return  # load_state_dict moved the position: this iterator is stale
        self.epoch, self.batch = epoch + 1, 0

    def _collate(self, epoch: int, batch: int, rank: int) -> Any:
        mine = self._mine(epoch, batch, rank)
        if mine:
            return self.collate_fn([self.dataset[i] for i in mine])
        # fewer rows than data ranks: this rank's shard is empty, shaped as one row's would be
        one = self.collate_fn([self.dataset[int(self.indices(epoch, batch)[0])]])
        return pytree.tree_map_only(torch.Tensor, lambda t: t[:0], one)

    def _global(self, local: torch.Tensor) -> torch.Tensor:
        return from_local(local, self.layout.placement, self.layout.sbp, shape=(self.batch_size, *local.shape[1:]))

    def state_dict(self) -> dict[str, int]:
        """The position (the next batch to hand out) and what fixes the order; the same on every rank."""
        epoch, batch = (self.epoch + 1, 0) if self.batch == self.per_epoch else (self.epoch, self.batch)
        return {"epoch": epoch, "batch": batch, "seed": self.seed, "shuffle": int(self.shuffle),
                "batch_size": self.batch_size, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position. Seed, shuffle, batch size and dataset length must be those that saved it:
        with any other, the batches after the position would not be the saved run's."""
        state = {k: int(v) for k, v in state.items()}
        missing = [k for k in _KEYS if k not in state]
        if missing:
            raise ValueError(f"Batches.load_state_dict(state): missing {missing} (a state from Batches.state_dict)")
        for k, here in (("seed", self.seed), ("shuffle", int(self.shuffle)), ("batch_size", self.batch_size),
                        ("dataset_len", len(self.dataset))):
            if state[k] != here:
                raise ValueError(f"Batches.load_state_dict(state): saved with {k}={state[k]}, this loader has "
                                 f"{k}={here}: the data order would differ from the saved run's (build the loader "
                                 f"with {k}={state[k]})")
        if not 0 <= state["batch"] <= self.per_epoch:
            raise ValueError(f"Batches.load_state_dict(state): batch {state['batch']} is outside an epoch of "
                             f"{self.per_epoch} batches")
        self.epoch, self.batch = state["epoch"], state["batch"]
