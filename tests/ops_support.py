"""Shared by tests/test_ops_*.py: run a function on GlobalTensors over a mesh and compare with one device."""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor import boxing
import dispatch_probe

MESHES = [(1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1), (3, 1), (1, 3)]


def mesh_placement(mesh: tuple) -> gt.Placement:
    return gt.placement("cpu", np.arange(math.prod(mesh)).reshape(mesh).tolist())


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
    """fn on GlobalTensors laid out as `sbps` on every rank: (outputs, input grads), each full, per rank."""
    n = math.prod(mesh)

    def body():
        p = mesh_placement(mesh)
        xs = [gt.to_global(t.detach(), p, s).requires_grad_(grad and t.is_floating_point())
              for t, s in zip(inputs, sbps)]
        outs = _forward_backward(fn, xs, grad, seed)
        fulls = [o.full_tensor() for o in outs]
        grads = [x.grad.full_tensor() if x.grad is not None else None for x in xs] if grad else []
        return fulls, grads, [o.sbp for o in outs]
    return gt.launch(body, n)


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
    for outs, grads, _ in results:
        for o, w in zip(outs, want_out):
            torch.testing.assert_close(o, w, **tol)
        for g, w in zip(grads, want_grad):
            if w is not None:
                torch.testing.assert_close(g, w, **tol)
    return results[0][2]


def chosen_is_cheapest(func, make_args, mesh):
    """The dispatcher's choice for `func(*make_args(placement))` costs no more than any valid candidate
    (input boxing plus what the outputs still owe)."""
    return dispatch_probe.chosen_is_cheapest(func, make_args, mesh, mesh_placement)