"""Shared by tests/test_ops_*.py: run a function on GlobalTensors over a mesh and compare with one device."""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from hypothesis import strategies as st

import globaltensor as gt
import dispatch_probe

MESHES = [(1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1), (3, 1), (1, 3)]


class Mesh(tuple):
    """A mesh shape (a tuple, as MESHES' entries) that also says which ranks of how large a world it
    covers, in mesh order; the world's other ranks are outside the placement and hold empty shards."""

    ranks: tuple
    world: int

    def __new__(cls, shape: tuple, ranks=None, world=None) -> "Mesh":
        m = super().__new__(cls, shape)
        m.ranks = tuple(range(math.prod(shape))) if ranks is None else tuple(ranks)
        m.world = len(m.ranks) if world is None else world
        return m

    def __repr__(self) -> str:
        return f"Mesh({tuple(self)}, ranks={self.ranks}, world={self.world})"


@st.composite
def meshes(draw, shapes=MESHES, extra_ranks: int = 2):
    """A mesh of `shapes` on some ranks (in random order) of a world that is, now and then, larger."""
    shape = draw(st.sampled_from(shapes))
    n = math.prod(shape)
    world = n + draw(st.sampled_from([0, 0] + list(range(1, extra_ranks + 1))))
    return Mesh(shape, draw(st.permutations(range(world)))[:n], world)


def world_of(mesh: tuple) -> int:
    return getattr(mesh, "world", math.prod(mesh))


def mesh_placement(mesh: tuple) -> gt.Placement:
    ranks = getattr(mesh, "ranks", range(math.prod(mesh)))
    return gt.placement("cpu", np.array(ranks).reshape(mesh).tolist())


@st.composite
def sbps_for(draw, mesh: tuple, shape: tuple, partial: bool = False):
    """One nd-SBP for a tensor of `shape` on `mesh` (splits of any dim, B, optionally P)."""
    choices = [st.just(gt.broadcast)] + ([st.integers(0, len(shape) - 1).map(gt.split)] if shape else [])
    if partial:
        choices.append(st.just(gt.partial_sum))
    return tuple(draw(st.one_of(*choices)) for _ in mesh)


def _forward_backward(fn, xs, grad, seed):
    """fn(*xs), then backward of a random weighting of its outputs (the same weights on every device)."""
    out = fn(*xs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if grad:
        torch.manual_seed(seed)
        loss = sum((o * torch.randn(o.shape, dtype=o.dtype)).sum() for o in outs if o.is_floating_point())
        loss.backward()
    return outs


def run_global(fn, inputs, mesh, sbps, grad=True, seed=0):
    """fn on GlobalTensors laid out as `sbps` on every rank of `mesh`'s world: per rank, (outputs, input
    grads) each full (as GlobalTensors' `full_tensor()`, empty outside the placement), the outputs'
    SBPs, and `outside`: None inside the placement, else what the rank holds as (global shape,
    dtype, local numel, local dtype) per output and per gradient."""
    def body():
        p = mesh_placement(mesh)
        xs = [gt.to_global(t.detach(), p, s).requires_grad_(grad and t.is_floating_point())
              for t, s in zip(inputs, sbps)]
        outs = _forward_backward(fn, xs, grad, seed)
        fulls = [o.full_tensor() for o in outs]
        grads = [x.grad.full_tensor() if x.grad is not None else None for x in xs] if grad else []
        outside = None
        if gt.rank() not in p.flat_ranks:
            held = [(tuple(t.shape), t.dtype, t._local.numel(), t._local.dtype) if isinstance(t, gt.GlobalTensor)
                    else None for t in outs]
            held_grads = [None if x.grad is None else (tuple(x.grad.shape), x.grad.dtype, x.grad._local.numel(),
                                                       x.grad._local.dtype) for x in xs]
            outside = (held, held_grads)
        return fulls, grads, [o.sbp for o in outs], outside
    return gt.launch(body, world_of(mesh))


def run_local(fn, inputs, grad=True, seed=0):
    xs = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    outs = _forward_backward(fn, xs, grad, seed)
    return [o.detach() for o in outs], [x.grad for x in xs] if grad else []


def check(fn, inputs, mesh, sbps, grad=True, **tol):
    """Forward values and input gradients on every rank equal the single-device ones."""
    want_out, want_grad = run_local(fn, inputs, grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_global(fn, inputs, mesh, sbps, grad)
    for rank, (outs, grads, _, outside) in enumerate(results):
        if outside is not None:
            check_outside(rank, outside, want_out, want_grad)
            continue
        for o, w in zip(outs, want_out):
            torch.testing.assert_close(o, w, **tol)
        for g, w in zip(grads, want_grad):
            if w is not None:
                torch.testing.assert_close(g, w, **tol)
    return results[0][2]


def check_outside(rank, outside, want_out, want_grad):
    """A rank outside the placement holds empty shards of the outputs' (and gradients') global shapes and dtypes."""
    held, held_grads = outside
    for h, w in list(zip(held, want_out)) + [(h, w) for h, w in zip(held_grads, want_grad) if w is not None]:
        assert h is not None, f"rank {rank} (outside the placement) got no GlobalTensor"
        shape, dtype, numel, local_dtype = h
        assert (shape, dtype) == (tuple(w.shape), w.dtype), f"rank {rank} outside: {shape} {dtype}, not {w.shape}"
        assert numel == 0 and local_dtype == w.dtype, f"rank {rank} outside holds {numel} elements of {local_dtype}"


def chosen_is_cheapest(func, make_args, mesh):
    """The dispatcher's choice for `func(*make_args(placement))` costs no more than any valid candidate
    (input boxing plus what the outputs still owe)."""
    return dispatch_probe.chosen_is_cheapest(func, make_args, mesh, mesh_placement)