"""Which ranks share a node, and what moving a byte (and launching a collective) costs on each kind of link.

Inside a node a GPU reaches its peers at ~450 GB/s (NVLink), between nodes at ~50 GB/s (InfiniBand): a
collective whose group spans nodes is bound by its slowest links. The job's topology is a fact of the launch,
not of a placement: torchrun numbers node k's workers k*G .. k*G + G - 1 (G = LOCAL_WORLD_SIZE), and the
simulator is told G (`gt.launch(..., ranks_per_node=G)`).

The cost of moving data is a time, per link class ("inside" a node, "across" nodes: `Placement.axis_kind`):
an alpha (seconds per collective launch or point-to-point message) and a beta (seconds per byte a rank
receives), the alpha-beta model of Hockney and of NCCL's own tuner; plus a compute rate (seconds per
floating-point operation of one rank), so that a choice leaving ranks idle costs the busy ranks' time.
One `LinkModel` is in force per job (`in_force()`): the simulator's, gloo's or NVLink/InfiniBand's by
default (`default_for`), or one measured by `gt.calibrate` (`install`). The boxing planner
(`boxing/cost.py`) and the op decisions (`ops/decide.py`) price every step by it, so a Partial over node
and local axes is reduced inside, across on 1/G of it, and gathered inside, as NCCL's and Megatron's
hierarchical all-reduces are; `gt.comm_log()` tells the bytes of collectives that span nodes from the rest
(`CommLog.by_link`).

Costs are compared as integer ticks (`TICK` seconds): sums of ints are exact, so two choices that move the
same bytes in the same collectives cost exactly alike and the tie-breaks decide, as they did on bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

TICK = 1e-18  # seconds: costs are compared as integer multiples (attoseconds)


def ticks(seconds: float) -> int:
    """`seconds` as integer ticks (exact sums, so ties stay ties)."""
    return round(seconds / TICK)


@dataclass(frozen=True)
class Link:
    """One link class: `alpha` seconds per collective launch (or point-to-point message), `beta` seconds per
    byte a rank receives (1 / its bandwidth)."""
    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, (int, float)) and self.alpha >= 0):
            raise ValueError(f"Link(alpha): seconds per collective launch, expected >= 0, got {self.alpha!r}")
        if not (isinstance(self.beta, (int, float)) and self.beta > 0):
            raise ValueError(f"Link(beta): seconds per byte received, expected > 0, got {self.beta!r}")

    @property
    def alpha_ticks(self) -> int:
        return ticks(self.alpha)

    @property
    def beta_ticks(self) -> int:
        return ticks(self.beta)


@dataclass(frozen=True)
class LinkModel:
    """What a step costs in time: per link class a `Link` (`inside` a node, `across` nodes), and `flop`
    seconds per floating-point operation on one rank (0: compute is not weighed). `source` says where the
    figures come from (defaults: their citations; `gt.calibrate`: the communicator it timed)."""
    inside: Link
    across: Link
    flop: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.flop, (int, float)) and self.flop >= 0):
            raise ValueError(f"LinkModel(flop): seconds per floating-point operation, expected >= 0, "
                             f"got {self.flop!r}")

    def link(self, kind: str) -> Link:
        """The link of a class: "inside" or "across" (`Placement.axis_kind`)."""
        if kind not in ("inside", "across"):
            raise ValueError(f"LinkModel.link(kind): 'inside' or 'across', got {kind!r}")
        return self.inside if kind == "inside" else self.across

    @property
    def across_cost(self) -> float:
        """A byte between nodes as this many bytes inside one (the bandwidth ratio, from the betas)."""
        return self.across.beta / self.inside.beta

    @property
    def flop_ticks(self) -> int:
        return ticks(self.flop)

    def seconds(self, t: int) -> float:
        """Ticks (what the planners compare) as seconds."""
        return t * TICK


# Defaults. Each is the alpha-beta fit of a kind of job; `gt.calibrate` measures the running one instead.
#
# NVLink/InfiniBand-class GPUs (a DGX H100 node): NVLink 4 is 900 GB/s per GPU both ways, 450 GB/s each way
# (NVIDIA H100 datasheet); NCCL's all-reduce bus bandwidth inside a DGX H100 reaches ~400-480 GB/s
# (nccl-tests), so beta = 1/400 GB/s. Between nodes each GPU has one ConnectX-7 NDR port, 400 Gb/s = 50 GB/s
# (NVIDIA ConnectX-7 datasheet), beta = 1/50 GB/s: 8x the inside beta, the ratio the planner used before
# it had times. Alpha: NCCL's small-message all-reduce latency is ~10 us inside a node and ~20-30 us across
# nodes (the order of nccl-tests' times at 8 B; approximate, which gt.calibrate replaces). Compute: ~400 TFLOP/s of dense bf16/tf32 matmul per H100 (989 TFLOP/s peak bf16 dense, ~40-60% of
# it in practice).
NVLINK_INFINIBAND = LinkModel(Link(10e-6, 1 / 400e9), Link(25e-6, 1 / 50e9), 1 / 400e12,
                              "defaults: NVLink 4 inside a node, NDR InfiniBand across (DGX H100 class)")
# gloo on CPUs over TCP: ~1 GB/s = 1 ns/B per rank over loopback or 10 GbE (1.25 GB/s line rate), 8x slower
# between machines once a node's ranks share its NIC; a gloo collective's launch costs tens of microseconds
# (gt.calibrate on this project's 2-core VM, two gloo processes on loopback under load: alpha ~500 us,
# beta ~4 ns/B; an idle machine does better). Compute: ~50 GFLOP/s of fp32 matmul per rank (gt.calibrate
# measured 40-95 GFLOP/s here).
GLOO_CPU = LinkModel(Link(50e-6, 1e-9), Link(100e-6, 8e-9), 1 / 50e9,
                     "defaults: gloo over TCP on CPUs (loopback inside a node, 10 GbE across)")
# The simulator's: bandwidth only (alpha 0, compute not weighed), the betas' 1:8 ratio of the GPU default.
# Under it a choice is the one that moves the fewest bytes (the busiest rank's, a byte between nodes as 8),
# ties broken by all ranks' bytes, then launches: the textbook plans that the tests count exactly. At the
# sizes a simulator runs (bytes to kilobytes), any realistic alpha outweighs the bytes (measured: with an
# alpha worth 10 bytes, boxing's property and example tests fail, routes trading bytes for launches; worth
# 10 kB, ZeRO-3's GPT step too), so the simulated programs would stop being the textbook's;
# `gt.link_model(GLOO_CPU)` or `gt.calibrate` puts a timed model in force instead.
SIMULATOR = LinkModel(Link(0.0, 1e-9), Link(0.0, 8e-9), 0.0,
                      "defaults of the simulator: bandwidth only (the textbook's bytes)")
MODELS = {"sim": SIMULATOR, "gloo": GLOO_CPU, "nvlink": NVLINK_INFINIBAND}


def default_for(backend: str) -> LinkModel:
    """The default link model of a communicator's backend ("sim", "gloo", "nccl"); `GT_LINK_MODEL` ("sim",
    "gloo", "nvlink") names one for every backend (a test suite that counts the simulator's bytes on gloo)."""
    named = os.environ.get("GT_LINK_MODEL")
    if named:
        if named not in MODELS:
            raise ValueError(f"GT_LINK_MODEL={named!r}: one of {sorted(MODELS)}")
        return MODELS[named]
    return {"sim": SIMULATOR, "gloo": GLOO_CPU, "nccl": NVLINK_INFINIBAND}.get(backend, GLOO_CPU)


_STATE: dict = {"model": SIMULATOR}
_ON_CHANGE: list[Callable[[], None]] = []


def in_force() -> LinkModel:
    """The link model every cost is priced by now."""
    return _STATE["model"]


def on_change(clear: Callable[[], None]) -> None:
    """Register a cache to `clear` whenever another link model comes into force (a decision cached under one
    model is not the decision under another)."""
    _ON_CHANGE.append(clear)


def install(model: LinkModel) -> LinkModel:
    """Put `model` in force for the job (every rank must install the same one: they decide alike); clears
    every cache of costs or decisions if it differs from the model in force. Returns the previous model."""
    if not isinstance(model, LinkModel):
        raise TypeError(f"install(model): expected a LinkModel, got {type(model).__name__}")
    old = _STATE["model"]
    if model != old:
        _STATE["model"] = model
        for clear in _ON_CHANGE:
            clear()
    return old


@dataclass(frozen=True)
class Topology:
    """`ranks_per_node`: G, global ranks k*G .. k*G + G - 1 on node k (None: one node, every link alike)."""
    ranks_per_node: Optional[int] = None

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(f"ranks_per_node: expected a positive int (or None: one node), got {self.ranks_per_node!r}")

    @property
    def across_cost(self) -> float:
        """A byte between nodes priced as this many bytes inside one: the link model's beta ratio."""
        return in_force().across_cost

    def node(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def crosses(self, ranks: Iterable[int]) -> bool:
        """Whether `ranks` (a collective's group, a message's two ends) span more than one node."""
        if self.ranks_per_node is None:
            return False
        return len({self.node(r) for r in ranks}) > 1

    @classmethod
    def from_environment(cls) -> "Topology":
        """torchrun's: LOCAL_WORLD_SIZE workers per node where the job has more ranks than that
        (`GT_RANKS_PER_NODE` overrides, e.g. to model nodes that one machine hosts)."""
        given = os.environ.get("GT_RANKS_PER_NODE")
        if given:
            return cls(int(given))
        local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        if local and world and int(local) < int(world):
            return cls(int(local))
        return cls()


ONE_NODE = Topology()
