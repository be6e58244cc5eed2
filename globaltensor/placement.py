"""Placement: a device type and the ranks a tensor spans, arranged as an n-d mesh."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .runtime.context import current_or_none
from .runtime.topology import ONE_NODE, Topology

DEVICE_TYPES = ("cpu", "cuda")


def _shape_and_flat(ranks: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Nested sequence of ints -> (mesh shape, row-major ranks); rejects ragged nesting."""
    if hasattr(ranks, "tolist"):  # numpy arrays and torch tensors
        ranks = ranks.tolist()
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        raise TypeError(f"placement(ranks): ranks must be a (nested) list of ints, got the int {ranks}; "
                        f"write [{ranks}] for a one-rank placement")
    if isinstance(ranks, range):
        ranks = list(ranks)
    if not isinstance(ranks, (list, tuple)):
        raise TypeError(f"placement(ranks): ranks must be a (nested) list of ints, got {type(ranks).__name__}")
    if len(ranks) == 0:
        raise ValueError("placement(ranks): ranks is empty; a placement needs at least one rank")
    if all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return (len(ranks),), tuple(ranks)
    if any(not isinstance(r, (list, tuple, range)) and not hasattr(r, "tolist") for r in ranks):
        raise ValueError(f"placement(ranks): ragged nesting in {ranks!r}; "
                         "every entry of one level must be a list of the same shape")
    parts = [_shape_and_flat(r) for r in ranks]
    shapes = {s for s, _ in parts}
    if len(shapes) != 1:
        raise ValueError(f"placement(ranks): ragged nesting in {ranks!r}: sub-meshes have shapes "
                         f"{sorted(shapes)}; every row must have the same shape")
    return (len(ranks),) + parts[0][0], tuple(r for _, flat in parts for r in flat)


@dataclass(frozen=True)
class Placement:
    """Immutable and hashable; equal placements share every cache entry.

    `ranks` is the nested list (as given), `flat_ranks` the row-major tuple.
    """
    device_type: str
    shape: tuple[int, ...]
    flat_ranks: tuple[int, ...]
    # which of the job's ranks share a node (runtime/topology.py): the job's, taken when the placement is made;
    # part of its identity, so every cache keyed by placements (routes, decisions) is keyed by it too
    topology: Topology = ONE_NODE
    # set in __post_init__, and not dataclass fields: a placement's fields are its constructor's arguments, so
    # torch.compile can rebuild one it meets as a constant of the graph (`to_global(placement, sbp)`)
    # _coords: dict, rank -> mesh coordinate;  _groups: per mesh axis, rank -> its group;  _hash: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.device_type, self.shape, self.flat_ranks, self.topology)))
        coords: dict[int, tuple[int, ...]] = {}
        strides = [1] * len(self.shape)
        for a in range(len(self.shape) - 2, -1, -1):
            strides[a] = strides[a + 1] * self.shape[a + 1]
        for i, r in enumerate(self.flat_ranks):
            coords[r] = tuple((i // strides[a]) % self.shape[a] for a in range(len(self.shape)))
        object.__setattr__(self, "_coords", coords)
        groups = []
        for a in range(len(self.shape)):
            by_rest: dict[tuple, list[int]] = {}
            for r, c in coords.items():
                by_rest.setdefault(c[:a] + c[a + 1:], []).append(r)
            groups.append({r: tuple(sorted(g, key=lambda q: coords[q][a]))
                           for g in by_rest.values() for r in g})
        object.__setattr__(self, "_groups", tuple(groups))

    # placements key every cache: hash once, and let identical objects compare at once
    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # str hashes differ between processes: rebuild, never pickle _hash
        return (load_placement, (self.device_type, self.shape, self.flat_ranks))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (isinstance(other, Placement) and self._hash == other._hash and self.device_type == other.device_type
                and self.shape == other.shape and self.flat_ranks == other.flat_ranks
                and self.topology == other.topology)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.flat_ranks)

    @property
    def ranks(self) -> list:
        def nest(flat: Sequence[int], shape: tuple[int, ...]) -> list:
            if len(shape) == 1:
                return list(flat)
            step = len(flat) // shape[0]
            return [nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
        return nest(self.flat_ranks, self.shape)

    def __contains__(self, rank: int) -> bool:
        return rank in self._coords

    def coord(self, rank: int) -> tuple[int, ...] | None:
        """This rank's index in the mesh, or None when the rank is outside the placement."""
        return self._coords.get(rank)

    def rank_at(self, coord: Sequence[int]) -> int:
        i = 0
        for a, c in enumerate(coord):
            i = i * self.shape[a] + c
        return self.flat_ranks[i]

    def group(self, rank: int, axis: int) -> tuple[int, ...]:
        """The ranks that differ from `rank` only along mesh axis `axis`, in mesh order."""
        return self._groups[axis][rank]

    def axis_groups(self, axis: int) -> list[tuple[int, ...]]:
        """All groups of mesh axis `axis` (the sub-communicators its collectives run on)."""
        seen = dict.fromkeys(self._groups[axis].values())
        return list(seen)

    @property
    def axis_kind(self) -> tuple[str, ...]:
        """Per mesh axis, "across" where its groups span nodes (the job's topology), else "inside": the link
        class its collectives run on (`runtime/topology.py`)."""
        return tuple("across" if any(self.topology.crosses(g) for g in self.axis_groups(a)) else "inside"
                     for a in range(self.ndim))

    def check_world(self, world_size: int) -> None:
        bad = [r for r in self.flat_ranks if r >= world_size]
        if bad:
            raise ValueError(f"placement: ranks {bad} are not in the world of size {world_size}; "
                             f"use ranks 0..{world_size - 1} or launch more processes")

    def __repr__(self) -> str:
        return f"placement({self.device_type!r}, {self.ranks})"


def load_placement(device_type: str, shape: tuple, flat_ranks: tuple) -> Placement:
    """A placement loaded (torch.load, a checkpoint): the job that loads it says which ranks share a node,
    not the one that saved it."""
    comm = current_or_none()
    return Placement(device_type, shape, flat_ranks, ONE_NODE if comm is None else comm.topology)


def node_mesh(device_type: str = "cpu") -> Placement:
    """The job's ranks as a (node, local) mesh: axis 0 across nodes, axis 1 inside one (torchrun's numbering:
    node k holds ranks k*G .. k*G + G - 1, G its LOCAL_WORLD_SIZE). HSDP is `{"*": (gt.broadcast, gt.split(0))}`
    with the parameters gathered inside a node; DP across nodes x TP inside is `tp_plan(tensor_axis=1, ndim=2)`
    with the batch split on axis 0. On one node: a 1 x world mesh."""
    comm = current_or_none()
    world = 1 if comm is None else comm.world_size
    per = (ONE_NODE if comm is None else comm.topology).ranks_per_node or world
    if world % per:
        raise ValueError(f"node_mesh: {world} ranks do not make whole nodes of {per}; give every node as many ranks")
    return placement(device_type, [[k * per + i for i in range(per)] for k in range(world // per)])


def placement(device_type: str, ranks: Sequence[int] | Sequence[Sequence[Any]]) -> Placement:
    """`placement("cpu", [[0, 1], [2, 3]])` is a 2x2 mesh over ranks 0-3.

    `ranks` nests one level per mesh axis (a flat list is a 1-D mesh); `device_type` is "cpu" or
    "cuda".
    """
    if not isinstance(device_type, str) or device_type not in DEVICE_TYPES:
        raise ValueError(f"placement(device_type): must be one of {DEVICE_TYPES}, got {device_type!r}")
    shape, flat = _shape_and_flat(ranks)
    bad = [r for r in flat if not isinstance(r, int) or isinstance(r, bool)]
    if bad:
        raise TypeError(f"placement(ranks): ranks must be ints, got {bad[:3]}")
    neg = [r for r in flat if r < 0]
    if neg:
        raise ValueError(f"placement(ranks): ranks must be >= 0, got {neg}")
    dup = sorted({r for r in flat if flat.count(r) > 1})
    if dup:
        raise ValueError(f"placement(ranks): duplicate ranks {dup}; each rank may appear once in a mesh")
    if any(s == 0 for s in shape):
        raise ValueError(f"placement(ranks): mesh shape {shape} has an empty axis")
    comm = current_or_none()
    p = Placement(device_type, shape, flat, ONE_NODE if comm is None else comm.topology)
    if comm is not None:
        p.check_world(comm.world_size)
    return p
