"""Communication: one Communicator interface, two backends (simulator, torch.distributed).

Imports flow failure, comm <- sim, dist <- context <- launch.
"""
from .comm import CommEvent, CommLog, Communicator
from .context import comm_log, current, rank, world_size
from .failure import CollectiveError, RankError
from .launch import launch

__all__ = ["CollectiveError", "CommEvent", "CommLog", "Communicator", "comm_log", "current",
           "rank", "world_size", "launch", "RankError"]
