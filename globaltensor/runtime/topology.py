"""Which ranks share a node, and what a byte between nodes costs next to a byte inside one.

Inside a node a GPU reaches its peers at ~300 GB/s (NVLink), between nodes at 25-50 GB/s: a collective whose
group spans nodes is bound by its slowest links. The job's topology is a fact of the launch, not of a
placement: torchrun numbers node k's workers k*G .. k*G + G - 1 (G = LOCAL_WORLD_SIZE), and the simulator is
told G (`gt.launch(..., ranks_per_node=G)`). The boxing planner prices a byte that crosses nodes `across_cost`
times a byte that does not (`boxing/cost.py`), so a Partial over node and local axes is reduced inside,
across on 1/G of it, and gathered inside, as NCCL's and Megatron's hierarchical all-reduces are; and
`gt.comm_log()` tells the bytes of collectives that span nodes from the rest (`CommLog.by_link`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class Topology:
    """`ranks_per_node`: G, global ranks k*G .. k*G + G - 1 on node k (None: one node, every link alike).
    `across_cost`: a byte between nodes priced as this many bytes inside one (the bandwidth ratio)."""
    ranks_per_node: Optional[int] = None
    across_cost: int = 8

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(f"ranks_per_node: expected a positive int (or None: one node), got {self.ranks_per_node!r}")
        if not isinstance(self.across_cost, int) or self.across_cost < 1:
            raise ValueError(f"across_cost: expected an int >= 1 (inside-node bandwidth / across-node bandwidth), "
                             f"got {self.across_cost!r}")

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
