"""torch's operator database (`op_db`) on global tensors, against plain torch (issue 34).

Each OpInfo entry (its function variant, and its in-place variant where it has one) runs its first
samples (float32, CPU) on simulated ranks with every tensor argument laid out by a `Layouts` rule
(S(0) where it has a dim 0, Broadcast where not, by default), and the gathered results, the
in-place target and, with `grad`, the input gradients are compared with the same sample on one
device. An outcome says whether every sample was equal, and which aten ops fell back (ran
replicated) on the way. Shared by tests/test_op_db.py (CI's sample and the full sweep behind
GT_OPDB=full) and bench/op_db.py (the table).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import globaltensor as gt

NATIVE, FALLBACK, WRONG, ERROR, SKIP = "native", "fallback", "wrong", "error", "skip"
TOL = dict(rtol=1e-4, atol=1e-5, equal_nan=True)  # fp32: a split sum or matmul reorders additions


@dataclass(frozen=True)
class Entry:
    """One callable of the database: an OpInfo's function or in-place variant."""
    key: str        # "name.variant" (variant_test_name, if any) and "_" for the in-place variant
    info: Any       # the OpInfo
    fn: Callable
    inplace: bool


def entries() -> list[Entry]:
    from torch.testing._internal.common_methods_invocations import op_db
    found = []
    for info in op_db:
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        name = info.name + ("." + info.variant_test_name if info.variant_test_name else "")
        found.append(Entry(name, info, info.op, False))
        if info.inplace_variant is not None:
            found.append(Entry(name + "_", info, info.inplace_variant, True))
    return found


@dataclass(frozen=True)
class Layouts:
    """How a sweep lays out each tensor argument: a mesh (ranks of a world) and an nd-SBP per tensor."""
    name: str
    mesh: tuple
    world: int
    ranks: Optional[tuple] = None  # the placement's ranks (default: the first prod(mesh))

    def placement(self) -> gt.Placement:
        ranks = self.ranks if self.ranks is not None else tuple(range(math.prod(self.mesh)))
        return gt.placement("cpu", np.array(ranks).reshape(self.mesh).tolist())

    def sbp(self, t: torch.Tensor) -> tuple:
        """Mesh axis k splits dim k (of those a tensor has), else Broadcast."""
        return tuple(gt.split(k) if k < t.dim() else gt.broadcast for k in range(len(self.mesh)))


LAYOUTS = {
    "1d4": Layouts("1d4", (4,), 4),                  # even-ish: most sample dims are 5, split 2,1,1,1
    "1d3": Layouts("1d3", (3,), 3),                  # uneven
    "world": Layouts("world", (3,), 4, (3, 0, 2)),   # a world larger than the mesh, ranks out of order
    "2x2": Layouts("2x2", (2, 2), 4),                # two dims split at once
}


@dataclass
class Outcome:
    key: str
    status: str
    fallbacks: tuple = ()
    detail: str = ""
    samples: int = 0

    def __str__(self) -> str:
        fb = f" fallbacks={list(self.fallbacks)}" if self.fallbacks else ""
        return f"{self.key}: {self.status}{fb} {self.detail}".rstrip()


def sample_inputs(entry: Entry, grad: bool, n: int) -> list:
    """The entry's first `n` OpInfo samples (none where torch cannot make them). Public: bench/op_db.py runs
    DTensor on the very samples the sweep runs globaltensor on, so the two columns count the same calls."""
    grad = grad and entry.info.supports_autograd and not entry.inplace
    try:
        it = entry.info.sample_inputs("cpu", torch.float32, requires_grad=grad)
        out = []
        for s in it:
            out.append(s)
            if len(out) >= n:
                break
        return out
    except Exception:
        return []


def run_plain(entry: Entry, sample: Any, grad: bool, seed: int) -> Any:
    """The sample on one device: (outputs, the in-place target after, input grads). Public: it is the oracle
    both columns of bench/op_db.py are compared against, so it must be this one."""
    inp, args, kwargs = pytree.tree_map_only(torch.Tensor, _fresh(grad), (sample.input, sample.args, sample.kwargs))
    torch.manual_seed(seed)
    out = entry.fn(inp, *args, **kwargs)
    return out, (inp.detach().clone() if entry.inplace else None), _grads(out, (inp, args, kwargs), grad, seed)


def _fresh(grad: bool) -> Callable:
    def make(t: torch.Tensor) -> torch.Tensor:
        c = t.detach().clone()
        return c.requires_grad_(grad and (c.is_floating_point() or c.is_complex()) and t.requires_grad)
    return make


def _grads(out: Any, inputs: Any, grad: bool, seed: int) -> list:
    if not grad:
        return []
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not leaves or not outs:
        return []
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, dtype=o.dtype, generator=gen)).sum().real for o in outs)
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [None if g is None else _full(g) for g in got]


def _full(x: Any) -> Any:
    if isinstance(x, gt.GlobalTensor):
        x = x.full_tensor()
    if isinstance(x, torch.Tensor):
        return x.detach().resolve_conj().resolve_neg()
    return x


def _global(entry: Entry, sample: Any, layouts: Layouts, grad: bool, seed: int) -> Any:
    """The sample on every rank of the layouts' world; rank 0's view of (outputs, target, grads)."""
    def body() -> Any:
        p = layouts.placement()

        def conv(t: torch.Tensor) -> torch.Tensor:
            g = gt.to_global(t.detach().clone(), p, layouts.sbp(t))
            return g.requires_grad_(grad and t.requires_grad and (t.is_floating_point() or t.is_complex()))
        inp, args, kwargs = pytree.tree_map_only(torch.Tensor, conv, (sample.input, sample.args, sample.kwargs))
        torch.manual_seed(seed)
        out = entry.fn(inp, *args, **kwargs)
        geometry = geometries(out)
        grads = _grads(out, (inp, args, kwargs), grad, seed)
        return pytree.tree_map(_full, out), (_full(inp) if entry.inplace else None), grads, geometry
    return gt.launch(body, layouts.world)[0]


def geometries(x: Any) -> list:
    """(shape, strides, storage offset) of every strided tensor leaf: a GlobalTensor's wrapper must say what
    one device's tensor says (as_strided and a view's legality read them)."""
    return [(tuple(t.shape), t.stride(), t.storage_offset()) if isinstance(t, torch.Tensor) and
            t.layout is torch.strided else None for t in pytree.tree_leaves(x)]


def difference(got: Any, want: Any, what: str) -> Optional[str]:
    """None if equal, else what differs. Public: bench/op_db.py judges DTensor's results by the same
    tolerance and structure check as the sweep's, or the side-by-side table would compare unlike things."""
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if g_spec != w_spec:
        return f"{what}: structure {g_spec} != {w_spec}"
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        if isinstance(w, torch.Tensor):
            w = w.detach().resolve_conj().resolve_neg()
            if not isinstance(g, torch.Tensor):
                return f"{what}[{i}]: {type(g).__name__}, not a tensor"
            if g.shape != w.shape or g.dtype != w.dtype:
                return f"{what}[{i}]: {tuple(g.shape)} {g.dtype} != {tuple(w.shape)} {w.dtype}"
            tol = dict(TOL)
            if (w.is_floating_point() or w.is_complex()) and w.layout == torch.strided:
                # an element that is a sum of large terms cancelling keeps their rounding, not its own size's:
                # a split sum's reordering moves it by ~eps x the terms (conv_transpose3d's input gradient on
                # 2x2: 5e-5 on values up to 238), so the absolute tolerance scales with the tensor's largest
                # value (8 eps of it); a missing or doubled contribution is of the values' own size
                finite = w.abs()[torch.isfinite(w.abs())] if w.numel() else w.abs()
                scale = finite.max().item() if finite.numel() else 0.0
                tol["atol"] = max(TOL["atol"], 1e-6 * scale)
            try:
                torch.testing.assert_close(g, w, **tol)
            except AssertionError as e:
                return f"{what}[{i}]: " + str(e).splitlines()[0] + " " + " ".join(str(e).splitlines()[1:3])
        elif isinstance(w, float) and isinstance(g, float) and (math.isnan(w) and math.isnan(g)):
            continue
        elif g != w and not (isinstance(w, float) and isinstance(g, float) and math.isclose(g, w, rel_tol=1e-5)):
            return f"{what}[{i}]: {g!r} != {w!r}"
    return None


def shapes_of(x: Any) -> Any:
    """(shape, dtype) in place of every tensor: what is compared where values are random or uninitialized
    (`deterministic`). Public for bench/op_db.py, which compares DTensor's results the same way."""
    return pytree.tree_map_only(torch.Tensor, lambda t: (tuple(t.shape), t.dtype), x)


class _Seeded(TorchDispatchMode):
    """Notes whether a plain run calls a random op (torch tags them) or one that leaves memory uninitialized."""
    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func._schema.name.split("::")[1]
        if torch.Tag.nondeterministic_seeded in func.tags or name.startswith(("empty", "new_empty")):
            self.found = True
        return func(*args, **(kwargs or {}))


def deterministic(entry: Entry, sample: Any) -> bool:
    """Whether the sample's values are defined: random ops (whose values on ranks are tests/test_ops_random.py's)
    and uninitialized ones (`empty_like`) are compared by shapes and dtypes only. Public: bench/op_db.py
    makes the same choice for DTensor's column."""
    with _Seeded() as mode:
        try:
            run_plain(entry, sample, False, 0)
        except Exception:
            pass
    return not mode.found


def sweep(entry: Entry, layouts: Layouts, grad: bool = False, samples: int = 3, seed: int = 0,
          strides: bool = False) -> Outcome:
    """Every sample of `entry` (up to `samples`) laid out by `layouts`, against one device; with `strides`, the
    outputs' strides and storage offsets too (a difference is WRONG)."""
    ran = 0
    gt.reset_stats()
    for sample in sample_inputs(entry, grad, samples):
        try:
            want_out, want_target, want_grads = run_plain(entry, sample, grad, seed)
        except Exception:
            continue  # torch itself refuses the sample (an in-place op whose result would promote)
        values = deterministic(entry, sample)  # else random or uninitialized (empty_like): shapes and dtypes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                got_out, got_target, got_grads, got_geometry = _global(entry, sample, layouts, grad, seed)
            except Exception as e:
                msg = (str(e).strip().splitlines() or [""])[-1][:300]
                return Outcome(entry.key, ERROR, _fallbacks(), f"{type(e).__name__}: {msg}", ran)
        ran += 1
        for got, want, what in ((got_out, pytree.tree_map(_full, want_out), "out"),
                                (got_target, want_target, "target"), (got_grads, want_grads, "grad")):
            diff = difference(got, want, what) if values else difference(shapes_of(got), shapes_of(want), what)
            if diff is not None:
                return Outcome(entry.key, WRONG, _fallbacks(), f"sample {ran - 1}: {diff}", ran)
        if strides and got_geometry != geometries(want_out):
            return Outcome(entry.key, WRONG, _fallbacks(), f"sample {ran - 1}: (shape, strides, offset) "
                           f"{got_geometry} != one device's {geometries(want_out)}", ran)
    if ran == 0:
        return Outcome(entry.key, SKIP, detail="no sample torch runs")
    fb = _fallbacks()
    return Outcome(entry.key, FALLBACK if fb else NATIVE, fb, "", ran)


def _fallbacks() -> tuple:
    return tuple(sorted(gt.stats()["fallback"]))


__all__ = ["Entry", "Layouts", "LAYOUTS", "Outcome", "entries", "sweep", "sample_inputs", "run_plain", "difference",
           "shapes_of", "deterministic", "geometries",
           "NATIVE", "FALLBACK", "WRONG", "ERROR", "SKIP"]
