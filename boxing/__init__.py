"""globaltensor.boxing: layouts -> route (cost, search) -> execution on a Communicator.

    route = gt.boxing.route(src_layout, dst_layout, shape, dtype)  # cached, pure data
    route.steps, route.recv_bytes, route.lower_bound, print(route.explain())
    local = gt.boxing.execute(route, local, comm)                  # every rank, same order
    locals = gt.boxing.execute_many(routes, locals, comm)          # one collective per bucket of such routes

Cost is time (`boxing/cost.py`): per step, an alpha per collective launch (a
point-to-point step counts the most peers one rank talks to) plus the busiest
rank's received bytes (DESIGN.md's convention per primitive) times the beta of
the link class they cross (the link model of `runtime/topology.py`); then all
ranks' bytes priced alike, launches, fewer point-to-point steps. Each term is
additive, so the shortest-path search is exact. Partial sources are reduced on the source placement (innermost mesh
axis first when ops differ) before data crosses to another placement.
"""
from .cost import launch_ticks, lower_bound, step_ticks
from .execute import all_reduce_key, bucket_key, convert_local, execute, execute_many, execute_many_start
from .route import RankExchange, Route, Step
from .search import route

__all__ = ["route", "Route", "Step", "RankExchange", "execute", "execute_many", "execute_many_start", "all_reduce_key", "bucket_key", "convert_local",
           "lower_bound", "step_ticks", "launch_ticks"]
