"""Hypothesis strategies shared by the tests: meshes, placements, shapes and nd-SBPs."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

import globaltensor as gt


@st.composite
def mesh_shapes(draw, max_ranks: int = 8, max_axes: int = 3) -> tuple[int, ...]:
    ndim = draw(st.integers(1, max_axes))
    shape: list[int] = []
    for _ in range(ndim):
        room = max_ranks // math.prod(shape) if shape else max_ranks
        shape.append(draw(st.integers(1, max(1, min(room, 4)))))
    return tuple(shape)


@st.composite
def placements(draw, max_ranks: int = 8, extra_ranks: int = 2) -> tuple[gt.Placement, int]:
    """A placement over a random subset (in random order) of a world that may be larger."""
    shape = draw(mesh_shapes(max_ranks))
    n = math.prod(shape)
    world = n + draw(st.integers(0, extra_ranks))
    ranks = draw(st.permutations(list(range(world))))[:n]
    return gt.placement("cpu", np.array(ranks).reshape(shape).tolist()), world


def tensor_shapes(max_ndim: int = 3, max_size: int = 7):
    return st.lists(st.integers(0, max_size), min_size=1, max_size=max_ndim).map(tuple)


def nd_sbps(mesh_ndim: int, tensor_ndim: int, partial: bool = False):
    choices = [st.just(gt.broadcast), st.integers(0, tensor_ndim - 1).map(gt.split)]
    if partial:
        choices.append(st.sampled_from(["sum", "max", "min"]).map(gt.partial))
    return st.tuples(*[st.one_of(*choices)] * mesh_ndim)


def expected_shard(t: np.ndarray, placement: gt.Placement, sbp, rank: int) -> np.ndarray:
    """The shard numpy.array_split semantics predict, computed without the library's arithmetic."""
    coord = placement.coord(rank)
    out = t
    for axis, s in enumerate(sbp):
        if isinstance(s, gt.Split):
            out = np.array_split(out, placement.shape[axis], axis=s.dim)[coord[axis]]
    return out
