"""globaltensor.boxing: layouts -> plan (cost, search) -> execution on a Communicator."""
from .cost import lower_bound
from .execute import convert_local, execute
from .plan import Plan, RankRoute, Step
from .search import plan

__all__ = ["plan", "Plan", "Step", "RankRoute", "execute", "convert_local", "lower_bound"]
