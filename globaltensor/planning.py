"""`gt.auto_plan`: a module plan chosen for you under a memory budget per rank, from measured costs.

A plan's cost is not guessed from a formula per strategy: each candidate runs one training step (forward,
backward, AdamW) on the simulator with every tensor on meta (`tools/explain.dry_run`: shapes only, no memory,
no arithmetic), and `gt.comm_log()` says what each rank receives, in how many collectives. A repeated block
(the children of the model's largest `nn.ModuleList` of identically shaped modules: a transformer's layers)
costs the same wherever it sits, so each candidate runs the model cut to one block and to two: the difference
is one block's bill, the rest (embeddings, head, loss) is the one-block run less that, and an L-block model's
bill is the rest plus L blocks' (bytes, collectives and stored state exactly: `tests/test_auto_plan.py`
compares them with a real step). A 32-layer model costs what a 2-layer one does to plan, and its width nothing
(meta); the mesh little: the runs are symmetric (`dry_run(symmetric=mesh)`, `runtime/symmetry.py`: one rank per
class of alike ranks, every rank where that cannot be exact).

Family: each mesh axis is a data axis or the tensor axis (at most one; Megatron TP, or TP + SP, from the
plans the caller or the model gives: `tensor_plans=`, else a Hugging Face model's own `gt.hf.tp_plan`), and one
data axis may also split a mixture of experts' experts (expert parallelism: `expert_plans=`). On the
data axes the batch is split and each part of the model (the root's own parameters, each block) is data
parallel ("dp": parameters Broadcast, gradients all-reduced), ZeRO-2 or ZeRO-3 (stored split on the first dim
tensor parallelism leaves whole, as `models/gpt.py`'s `zero_plan` does). Blocks are identical, so the solver
chooses how many blocks take each strategy (every composition, exactly), for every root strategy and axis
assignment: an exhaustive search over the family, minimising predicted time under the budget.

Memory per rank (peak, bytes): parameters, gradients and optimizer state as their shards are stored after a
step (measured), the activations autograd saves at the forward's end (`ActivationMeter`: this rank's shards,
parameters and their gathered copies excluded), the gathered copies held then (ZeRO-2 keeps a block's until
its backward), and, with ZeRO-3 parts, twice the largest ZeRO-3 group's gathered copy (the backward's
re-gather and its prefetch). Time per rank: `step_time` of its collectives, bytes and its share of the step's
FLOPs (`torch.utils.flop_counter` on one device); the step waits on the slowest rank.

Not in the family yet: ZeRO-1 (its sharded optimizer state is no plan entry), Ulysses/ring sequence splits,
pipeline stages, a different strategy per mesh axis of the data axes (HSDP), mixed precision. A ZeRO root
gathers every block without a group of its own (FSDP's root), so ZeRO roots are paired with ZeRO blocks only.
"""
from __future__ import annotations

import copy
import fnmatch
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from .api import to_global
from .hf import model_tp_plan, tp_plan as hf_tp_plan
from .layout import normalize_sbp
from .parallel.module import ModuleLayout, zero_stored
from .parallel.pipeline import ActivationMeter
from .parallel.zero import gathered_bytes
from .placement import Placement
from .runtime import comm_log, launch
from .runtime.topology import GLOO_CPU, LinkModel, in_force
from .sbp import Broadcast, Split
from .tensor import GlobalTensor
from .tools.explain import dry_run

__all__ = ["auto_plan", "AutoPlan", "Figures", "measure", "step_time", "planning_links"]

DATA_STRATEGIES = ("dp", "zero2", "zero3")
# seconds a dry-run rank may wait in a collective where every rank runs (a symmetric run refused): the simulator
# runs the ranks one at a time, so on 64 ranks a wait spans 63 ranks' work (the default 300 s timed out planning the
# 8B-shaped GPT on a loaded 2-core machine)
DRY_RUN_TIMEOUT = 3600.0


def planning_links() -> LinkModel:
    """The link model plans are timed by: the one in force (`runtime/topology.py`, `gt.calibrate`) where it weighs
    time; where it weighs bytes alone (the simulator's default, so that op decisions are the textbook's), gloo's."""
    links = in_force()
    return links if links.inside.alpha > 0 or links.flop > 0 else GLOO_CPU


def step_time(collectives: Any, recv_bytes: Any, flops: Any, links: Optional[LinkModel] = None) -> Any:
    """Seconds one rank spends on a step: a latency per collective, its received bytes at the link's bandwidth,
    its arithmetic at the rank's rate (no overlap assumed), by `links` (default `planning_links()`). Numbers or
    numpy arrays (one entry per rank)."""
    links = links or planning_links()
    return links.inside.alpha * collectives + recv_bytes * links.inside.beta + flops * links.flop


@dataclass(frozen=True)
class Figures:
    """Per rank (rank order) and step: what it receives, in how many collectives, what it holds."""
    recv_bytes: tuple
    collectives: tuple
    persistent: tuple         # parameters + gradients + optimizer state, as stored
    activations: tuple        # saved for the backward at the forward's end
    gathered: tuple           # gathered parameter copies held at the forward's end

    def __add__(self, other: "Figures") -> "Figures":
        return Figures(*(tuple(a + b for a, b in zip(x, y)) for x, y in zip(self._fields(), other._fields())))

    def __sub__(self, other: "Figures") -> "Figures":
        return self + other.scaled(-1)

    def scaled(self, k: int) -> "Figures":
        return Figures(*(tuple(k * a for a in x) for x in self._fields()))

    def _fields(self) -> tuple:
        return (self.recv_bytes, self.collectives, self.persistent, self.activations, self.gathered)


@dataclass(frozen=True)
class Axes:
    """Which mesh axes carry the batch (data) and which one splits the weights (tensor), with the tensor plan's name;
    and the data axis, if any, that also splits the experts (expert parallelism), with the expert plan's name."""
    data: tuple
    tensor: Optional[int]
    tensor_plan: Optional[str]
    expert: Optional[int] = None
    expert_plan: Optional[str] = None

    def __str__(self) -> str:
        names = [(f"data + experts ({self.expert_plan})" if a == self.expert else "data") if a in self.data
                 else f"tensor ({self.tensor_plan})" for a in range(len(self.data) + (self.tensor is not None))]
        return " x ".join(names)


@dataclass(frozen=True, eq=False)
class Candidate:
    """One plan of the family: the axes, the root's strategy, how many blocks take each data strategy, and its
    predicted figures (`table`: Figures' five fields x ranks; `peaks`, `times`: per rank)."""
    axes: Axes
    root: str
    blocks: tuple              # (strategy, count) in DATA_STRATEGIES order, counts summing to the depth
    table: np.ndarray = field(repr=False)
    peaks: np.ndarray = field(repr=False)
    times: np.ndarray = field(repr=False)
    flops: float = 0.0

    @property
    def time(self) -> float:
        return float(self.times.max())

    @property
    def peak_memory(self) -> int:
        return int(self.peaks.max())

    @property
    def figures(self) -> Figures:
        return Figures(*(tuple(int(v) for v in row) for row in self.table))

    def block_strategies(self) -> list[str]:
        return [s for s, k in self.blocks for _ in range(k)]


@dataclass
class AutoPlan:
    """`gt.auto_plan`'s answer: `.plan` for `gt.to_global(model, mesh, plan)`, `.predicted` (per rank and step:
    recv_bytes, collectives, peak_memory, time; the busiest rank's in `.predicted["max"]`), `.explain()`."""
    plan: dict
    predicted: dict
    chosen: Candidate
    candidates: list = field(repr=False)
    skipped: dict = field(repr=False)
    memory_per_rank: float = math.inf
    solve_seconds: float = 0.0
    measure_seconds: float = 0.0
    blocks: Optional[str] = None
    depth: int = 0
    plan_of: Callable[[Candidate], dict] = field(default=lambda c: {}, repr=False)  # any candidate's module plan

    def within(self, memory_per_rank: float) -> "AutoPlan":
        """The same search under another budget (nothing measured again)."""
        return _choose(self.candidates, memory_per_rank, self.plan_of, self.skipped, self.blocks, self.depth,
                       self.measure_seconds)

    def explain(self) -> str:
        """Each choice with its predicted time and memory, against the best plan that chooses otherwise there."""
        c = self.chosen
        lines = [f"auto_plan: {describe(c, self.blocks)}",
                 f"  predicted per step (busiest rank): {_ms(c.time)}, {max(c.figures.recv_bytes):,} B received in "
                 f"{max(c.figures.collectives)} collectives, peak {_mib(c.peak_memory)} of "
                 f"{_mib(self.memory_per_rank)}",
                 f"  planned from {len(self.candidates)} candidates in {self.solve_seconds:.3f} s (measured in "
                 f"{self.measure_seconds:.1f} s)"]
        decisions = [("axes", lambda x: x.axes, lambda x: str(x.axes)),
                     ("root parameters", lambda x: x.root, lambda x: x.root)]
        if self.depth:
            decisions.append((f"{self.blocks} ({self.depth})", lambda x: x.blocks,
                              lambda x: ", ".join(f"{k} {s}" for s, k in x.blocks if k)))
        for what, key, show in decisions:
            others = [x for x in self.candidates if key(x) != key(c)]
            if not others:
                continue
            fits = [x for x in others if x.peak_memory <= self.memory_per_rank]
            best = min(fits or others, key=_rank)
            verdict = "fits" if fits else "over budget"
            lines.append(f"  {what}: {show(c)} ({_ms(c.time)}, {_mib(c.peak_memory)}); next best {show(best)}: "
                         f"{_ms(best.time)}, {_mib(best.peak_memory)} ({verdict}: {describe(best, self.blocks)})")
        for name, why in self.skipped.items():
            lines.append(f"  not measured: {name}: {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _rank(c: Candidate) -> tuple:
    return (c.time, c.peak_memory)


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def _mib(b: float) -> str:
    return "unbounded" if b == math.inf else f"{b / 2 ** 20:.3f} MiB"


def describe(c: Candidate, blocks: Optional[str]) -> str:
    """One line: the axes, the root's strategy, the blocks' strategies."""
    parts = [f"axes {c.axes}", f"root {c.root}"]
    if blocks is not None:
        parts.append(f"{blocks}: " + ", ".join(f"{k} {s}" for s, k in c.blocks if k))
    return "; ".join(parts)


# -- the model's repeated blocks ---------------------------------------------------------------------------------

def _signature(m: torch.nn.Module) -> tuple:
    return (type(m),) + tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())


def repeated_blocks(model: torch.nn.Module) -> Optional[str]:
    """The name of the model's largest `nn.ModuleList` whose children are alike (same class, same parameter names,
    shapes and dtypes): a transformer's layers. None where there is none."""
    best, size = None, 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 1 and len({_signature(c) for c in m}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = name, n
    return best


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` on meta whose tied parameters stay tied (`.to("meta")` gives each module its own new
    Parameter, which unties a tied head)."""
    memo: dict = {}
    for _, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _cut(model: torch.nn.Module, blocks: Optional[str], depth: Optional[int]) -> torch.nn.Module:
    """A meta copy of `model` with its block list cut to its first `depth` blocks (the model itself is unchanged)."""
    if blocks is None or depth is None:
        return meta_copy(model)
    parent_name, _, attr = blocks.rpartition(".")
    parent = model.get_submodule(parent_name)
    whole = getattr(parent, attr)
    setattr(parent, attr, torch.nn.ModuleList(list(whole)[:depth]))
    try:
        return meta_copy(model)
    finally:
        setattr(parent, attr, whole)


# -- the plans of the family ---------------------------------------------------------------------------------------

def _as_tuple(sbp: Any, ndim: int) -> tuple:
    return tuple(normalize_sbp(sbp, ndim)) if not isinstance(sbp, tuple) else sbp


def family_plan(model: torch.nn.Module, axes: Axes, ndim: int, root: str, block_strategies: Sequence[str],
                blocks: Optional[str], tensor_plans: Mapping[str, Callable[[int, int], dict]]) -> dict:
    """The module plan of one candidate: the tensor plan's entries on its axis, each parameter stored split over
    the data axes on the first dim the tensor split leaves whole where its part is ZeRO (Broadcast where "dp"),
    and a `ModuleLayout(params=...)` per ZeRO part (the root's "", each block's)."""
    tp = tensor_plans[axes.tensor_plan](axes.tensor, ndim) if axes.tensor is not None else {}
    ep = tensor_plans[axes.expert_plan](axes.expert, ndim) if axes.expert is not None else {}
    t_sbps = [(k, v) for plan_ in (ep, tp) for k, v in plan_.items() if not isinstance(v, ModuleLayout)]
    t_hints = {k: v for plan_ in (tp, ep) for k, v in plan_.items() if isinstance(v, ModuleLayout)}
    if ep and (root != "dp" or any(s != "dp" for s in block_strategies)):
        keep = (None,) * ndim  # the experts are used as stored: a ZeRO block's gather leaves them out
        t_hints.update({k: replace(v, params=keep) for k, v in ep.items() if isinstance(v, ModuleLayout)})

    def stored(name: str, dims: int, strategy: str) -> tuple:
        given = next((_as_tuple(v, ndim) for k, v in t_sbps if fnmatch.fnmatchcase(name, k)), None)
        out = given if given is not None else (Broadcast(),) * ndim
        return zero_stored(out, dims, tuple(axes.data)) if strategy != "dp" else tuple(out)

    use = tuple(Broadcast() if a in axes.data else None for a in range(ndim))
    plan: dict = {}
    block_names = set()
    depth = len(block_strategies)
    if blocks is not None:
        first = model.get_submodule(blocks)[0]
        counts = {s: block_strategies.count(s) for s in DATA_STRATEGIES}
        common = max(DATA_STRATEGIES, key=lambda s: counts[s])
        for i, s in enumerate(block_strategies):  # the blocks that differ from the most common strategy, by name
            if s != common:
                for rel, p in first.named_parameters():
                    plan[f"{blocks}.{i}.{rel}"] = stored(f"{blocks}.{i}.{rel}", p.dim(), s)
        for rel, p in first.named_parameters():
            plan[f"{blocks}.*.{rel}"] = stored(f"{blocks}.0.{rel}", p.dim(), common)
        block_names = {f"{blocks}.{i}." for i in range(depth)}
    for name, p in model.named_parameters():
        if not any(name.startswith(b) for b in block_names):
            plan[name] = stored(name, p.dim(), root)
    whole = (Broadcast(),) * ndim
    overriding = {k for k in plan if blocks is not None and k.startswith(blocks + ".") and "*" not in k}
    for k in [k for k, v in plan.items() if v == whole and k not in overriding]:
        del plan[k]  # Broadcast is what an unnamed parameter gets (a deviating block's entries override a pattern)
    plan.update(t_hints)
    if blocks is not None and axes.data:  # each ZeRO block gathers its own parameters (FSDP's unit)
        if len(set(block_strategies)) == 1 and common != "dp":
            plan[f"{blocks}.*"] = ModuleLayout(params=use, reshard_after_forward=common == "zero3")
        else:
            for i, s in enumerate(block_strategies):
                if s != "dp":
                    plan[f"{blocks}.{i}"] = ModuleLayout(params=use, reshard_after_forward=s == "zero3")
    if root != "dp" and axes.data:
        plan[""] = ModuleLayout(params=use, reshard_after_forward=root == "zero3")
    return plan


def batch_sbp(axes: Axes, ndim: int) -> tuple:
    """The example batch's layout: dim 0 split over the data axes, whole on the tensor axis."""
    return tuple(Split(0) if a in axes.data else Broadcast() for a in range(ndim))


# -- measuring one step ------------------------------------------------------------------------------------------

def _loss_of(out: Any) -> torch.Tensor:
    """The model's loss in its output: the output if a scalar, `out.loss`, `out["loss"]`, or a tuple's scalar item."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(out, (tuple, list)):
        for x in out:
            if isinstance(x, torch.Tensor) and x.dim() == 0:
                return x
    raise ValueError(f"auto_plan: the model's output ({type(out).__name__}) holds no scalar loss; pass loss_fn=")


def _nbytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    local = t.to_local() if isinstance(t, GlobalTensor) else t
    return local.numel() * local.element_size()


def _inputs(example_inputs: Any, mesh: Placement, sbp: tuple, device: Optional[str]) -> tuple:
    args, kwargs = (example_inputs, {}) if not isinstance(example_inputs, Mapping) else ((), dict(example_inputs))
    if isinstance(args, torch.Tensor):
        args = (args,)

    def lay(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device) if device is not None else t
        return to_global(t, mesh, sbp if t.dim() else tuple(Broadcast() for _ in sbp))
    return tuple(lay(a) for a in args), {k: lay(v) for k, v in kwargs.items()}


def _step(model: torch.nn.Module, mesh: Placement, plan: dict, example_inputs: Any, sbp: tuple,
          loss_fn: Callable, device: Optional[str] = None) -> tuple:
    """This rank's figures of one AdamW training step of `model` (converted here) under `plan`: its comm log (a
    symmetric dry run's holds the bytes of every rank it stands for), stored, saved and gathered bytes."""
    to_global(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args, kwargs = _inputs(example_inputs, mesh, sbp, device)
    meter = ActivationMeter(model)
    meter.watch_parameters()
    with comm_log() as log:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            loss = loss_fn(model(*args, **kwargs))
        activations, gathered = meter.live, gathered_bytes()
        loss.backward()
        opt.step()
    persistent = sum(_nbytes(p) + _nbytes(p.grad) + sum(_nbytes(s) for s in opt.state[p].values())
                     for p in model.parameters())
    return log, persistent, activations, gathered


def _figures(per_rank: list) -> Figures:
    """Each rank's `_step` (rank order) as Figures (a symmetric dry run's ranks share their class's log)."""
    tallies: dict = {}
    for rank, r in enumerate(per_rank):
        tallies.setdefault(id(r[0]), (r[0], []))[1].append(rank)
    comm = {rank: t for log, ranks in tallies.values() for rank, t in log.per_rank(ranks).items()}
    return Figures(tuple(comm[rank][0] for rank in range(len(per_rank))),
                   tuple(comm[rank][1] for rank in range(len(per_rank))),
                   *(tuple(int(r[i]) for r in per_rank) for i in range(1, 4)))


def measure(model: torch.nn.Module, example_inputs: Any, mesh: Placement, plan: dict, *, sbp: Optional[tuple] = None,
            loss_fn: Optional[Callable[[Any], torch.Tensor]] = None, dry: bool = True,
            symmetric: bool = True) -> Figures:
    """One training step (forward, backward, AdamW) of `model` under `plan`: each rank's figures. `dry`: on meta
    tensors (`dry_run`: any size; `symmetric`: one rank per class of alike ranks where that is exact, else every
    rank); else on the simulator with the model's values (a copy; `model` is unchanged)."""
    sbp = sbp if sbp is not None else tuple(Split(0) if a == 0 else Broadcast() for a in range(mesh.ndim))
    loss_fn = loss_fn or _loss_of
    n = len(mesh.flat_ranks)
    if dry:
        template = meta_copy(model)
        return _figures(dry_run(lambda: _step(copy.deepcopy(template), mesh, plan, example_inputs, sbp, loss_fn,
                                              "meta"), n, timeout=DRY_RUN_TIMEOUT,
                                      symmetric=mesh if symmetric else None))
    return _figures(launch(lambda: _step(copy.deepcopy(model), mesh, plan, example_inputs, sbp, loss_fn), n))


# -- the solver ----------------------------------------------------------------------------------------------------

def _compositions(total: int, parts: int) -> list[tuple]:
    """Every way to write `total` as an ordered sum of `parts` non-negative counts."""
    if parts == 1:
        return [(total,)]
    return [(k,) + rest for k in range(total + 1) for rest in _compositions(total - k, parts - 1)]


def _flops(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable) -> float:
    """FLOPs of one forward and backward of `model` (a meta copy) on one device."""
    args, kwargs = (example_inputs, {}) if not isinstance(example_inputs, Mapping) else ((), dict(example_inputs))
    args = (args,) if isinstance(args, torch.Tensor) else args
    meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})).backward()
    return float(counter.get_total_flops())


def _batch_rows(example_inputs: Any) -> int:
    values = example_inputs.values() if isinstance(example_inputs, Mapping) else (
        [example_inputs] if isinstance(example_inputs, torch.Tensor) else example_inputs)
    return next(v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim())


def _axes_family(mesh: Placement, tensor_plans: Mapping, expert_plans: Mapping) -> list[Axes]:
    ndim = mesh.ndim
    family = [Axes(tuple(range(ndim)), None, None)]
    for t in range(ndim):
        for name in tensor_plans:
            family.append(Axes(tuple(a for a in range(ndim) if a != t), t, name))
    for axes in list(family):
        for e in axes.data:
            for name in expert_plans:
                family.append(replace(axes, expert=e, expert_plan=name))
    return family


def auto_plan(model: torch.nn.Module, example_inputs: Any, mesh: Placement, memory_per_rank: float = math.inf, *,
              tensor_plans: Optional[Mapping[str, Callable[[int, int], dict]]] = None,
              expert_plans: Optional[Mapping[str, Callable[[int, int], dict]]] = None,
              loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> AutoPlan:
    """A module plan for `model` on `mesh` whose predicted peak memory per rank is at most `memory_per_rank` bytes
    and whose predicted step time is the least of the family (see the module's docstring), for one AdamW training
    step on `example_inputs` (a tuple of positional inputs or a dict of keyword inputs, batch on dim 0; the model's
    output holds its loss, or `loss_fn(output)` gives it). `model` may live on meta; it is not changed.

    `tensor_plans`: {name: f(tensor_axis, ndim) -> plan} for the tensor axis (e.g. `models/gpt.py`'s `tp_plan`
    and `sp_plan`); default a Hugging Face model's own (`gt.hf.tp_plan`), else none (data axes only).
    `expert_plans`: {name: f(expert_axis, ndim) -> plan} placing a mixture of experts' experts on a data axis (expert
    parallelism with the batch split there too, e.g. `models/moe.py`'s `ep_plan`); the experts keep their split
    whatever the block's data strategy (used as stored under ZeRO, as `moe_gpt_plan(zero=True)` has them).
    Raises ValueError naming the smallest memory_per_rank that some plan of the family fits."""
    if any(isinstance(p, GlobalTensor) for p in model.parameters()):
        raise ValueError("auto_plan(model): already converted (its parameters are GlobalTensors); pass the "
                         "single-device model")
    started = time.perf_counter()
    links = planning_links()  # the caller's, before the dry runs start worlds of their own
    loss_fn = loss_fn or _loss_of
    if tensor_plans is None:
        tensor_plans = {"tp": None} if model_tp_plan(model) else {}
    plans = {name: (lambda m, a, n: hf_tp_plan(m, a, n)) if f is None else (lambda m, a, n, f=f: f(a, n))
             for name, f in tensor_plans.items()}
    expert_plans = dict(expert_plans or {})
    if set(expert_plans) & set(plans):
        raise ValueError(f"auto_plan: {sorted(set(expert_plans) & set(plans))} name both a tensor and an expert plan")
    plans.update({name: (lambda m, a, n, f=f: f(a, n)) for name, f in expert_plans.items()})
    blocks = repeated_blocks(model)
    depth = len(model.get_submodule(blocks)) if blocks is not None else 0
    ndim, n = mesh.ndim, len(mesh.flat_ranks)
    cuts = [_cut(model, blocks, 1), _cut(model, blocks, 2)] if blocks is not None else [_cut(model, None, None)]
    flops = [_flops(copy.deepcopy(c), example_inputs, loss_fn) for c in cuts]
    flops_base, flops_block = (2 * flops[0] - flops[1], flops[1] - flops[0]) if blocks else (flops[0], 0.0)
    rows = _batch_rows(example_inputs)

    measured: dict = {}
    skipped: dict = {}
    for axes in _axes_family(mesh, {k: v for k, v in plans.items() if k not in expert_plans}, expert_plans):
        for s in (DATA_STRATEGIES if axes.data else ("dp",)):
            cut_plans = [family_plan(c, axes, ndim, s, [s] * (i + 1) if blocks else [], blocks, _bound(plans, c))
                         for i, c in enumerate(cuts)]
            sbp = batch_sbp(axes, ndim)
            try:
                runs = dry_run(lambda: [_step(copy.deepcopy(c), mesh, p, example_inputs, sbp, loss_fn, "meta")
                                        for c, p in zip(cuts, cut_plans)], n, timeout=DRY_RUN_TIMEOUT,
                               symmetric=mesh)
            except Exception as e:  # noqa: BLE001  (a plan that cannot run is no candidate; explain() says why)
                skipped[f"axes {axes}, {s}"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                continue
            one = _figures([r[0] for r in runs])
            if blocks is None:
                measured[axes, s] = (one, one.scaled(0))
            else:
                two = _figures([r[1] for r in runs])
                measured[axes, s] = (one.scaled(2) - two, two - one)
    measure_seconds = time.perf_counter() - started
    started = time.perf_counter()

    candidates = []
    for axes in sorted({a for a, _ in measured}, key=str):
        strategies = [s for s in (DATA_STRATEGIES if axes.data else ("dp",)) if (axes, s) in measured]
        data = math.prod(mesh.shape[a] for a in axes.data)
        tensor = mesh.shape[axes.tensor] if axes.tensor is not None else 1
        share = math.ceil(rows / data) / rows / tensor  # the busiest rank's part of the step's arithmetic
        step_flops = (flops_base + depth * flops_block) * share
        z2 = measured.get((axes, "zero2"))
        base = {s: np.array(measured[axes, s][0]._fields(), dtype=np.int64) for s in strategies}
        block = np.stack([np.array(measured[axes, s][1]._fields(), dtype=np.int64) for s in strategies])
        group = {"block": np.array(z2[1].gathered) if z2 else np.zeros(n, np.int64),
                 "root": np.array(z2[0].gathered) if z2 else np.zeros(n, np.int64)}
        for root in strategies:
            for counts in _compositions(depth, len(strategies)):
                by = dict(zip(strategies, counts))
                if root != "dp" and by.get("dp"):
                    continue  # a ZeRO root gathers the parameters of every block without its own group
                table = base[root] + np.tensordot(np.array(counts, dtype=np.int64), block, axes=1)
                groups = ([group["block"]] if by.get("zero3") else []) + ([group["root"]] if root == "zero3" else [])
                regather = 2 * np.max(groups, axis=0) if groups else 0  # the backward's re-gather and its prefetch
                peaks = table[2] + table[3] + table[4] + regather
                times = step_time(table[1], table[0], step_flops, links)  # per rank (numpy arrays)
                candidates.append(Candidate(axes, root, tuple(zip(strategies, counts)), table, peaks, times,
                                            step_flops))
    if not candidates:
        raise ValueError("auto_plan: no plan of the family could run: " + "; ".join(f"{k}: {v}" for k, v in
                                                                                   skipped.items()))

    def plan_of(c: Candidate) -> dict:
        order = ("zero3", "zero2", "dp")  # the blocks that shard most come first (any order costs the same)
        strategies = sorted(c.block_strategies(), key=order.index)
        return family_plan(model, c.axes, ndim, c.root, strategies, blocks, _bound(plans, model))
    return _choose(candidates, memory_per_rank, plan_of, skipped, blocks, depth, measure_seconds, started)


def _choose(candidates: list, memory_per_rank: float, plan_of: Callable, skipped: dict, blocks: Optional[str],
            depth: int, measure_seconds: float, started: Optional[float] = None) -> AutoPlan:
    """The fastest candidate within the budget (then the smaller), as an AutoPlan; `started`: when the solve began."""
    started = time.perf_counter() if started is None else started
    fits = [c for c in candidates if c.peak_memory <= memory_per_rank]
    if not fits:
        least = min(candidates, key=lambda c: (c.peak_memory, c.time))
        raise ValueError(f"auto_plan(memory_per_rank={memory_per_rank:,}): no plan of the family fits; the smallest "
                         f"memory_per_rank that works is {least.peak_memory:,} bytes "
                         f"({_mib(least.peak_memory)}: {describe(least, blocks)})")
    chosen = min(fits, key=_rank)
    solve_seconds = time.perf_counter() - started
    figs = chosen.figures
    predicted = {"recv_bytes": figs.recv_bytes, "collectives": figs.collectives,
                 "peak_memory": tuple(int(p) for p in chosen.peaks), "time": tuple(float(t) for t in chosen.times),
                 "batch_sbp": batch_sbp(chosen.axes, len(chosen.axes.data) + (chosen.axes.tensor is not None))}
    predicted["max"] = {k: max(v) for k, v in predicted.items() if k != "batch_sbp"}
    return AutoPlan(plan_of(chosen), predicted, chosen, candidates, skipped, memory_per_rank, solve_seconds,
                    measure_seconds, blocks, depth, plan_of)


def _bound(plans: Mapping, model: torch.nn.Module) -> dict:
    """The tensor plans as f(axis, ndim) for `model` (a Hugging Face plan names the model's own modules)."""
    return {name: (lambda a, n, f=f: f(model, a, n)) for name, f in plans.items()}
