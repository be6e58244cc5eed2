"""Communication: one Communicator interface, two backends (simulator, torch.distributed)."""
from .comm import CollectiveError, CommEvent, CommLog, Communicator, comm_log
from .context import current, rank, world_size
from .launch import RankError, launch

__all__ = ["CollectiveError", "CommEvent", "CommLog", "Communicator", "comm_log", "current",
           "rank", "world_size", "launch", "RankError"]
