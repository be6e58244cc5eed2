"""globaltensor.boxing: layouts -> route (cost, search) -> execution on a Communicator.

    route = gt.boxing.route(src_layout, dst_layout, shape, dtype)  # cached, pure data
    route.steps, route.recv_bytes, route.lower_bound, print(route.explain())
    local = gt.boxing.execute(route, local, comm)                  # every rank, same order
    locals = gt.boxing.execute_many(routes, locals, comm)          # one collective per bucket of such routes

Cost is the total of bytes received over all ranks (DESIGN.md's convention per
primitive; a byte between nodes counts as the topology's `across_cost` bytes), then latency terms (one per collective; a point-to-point step
counts the most peers one rank talks to), then fewer point-to-point steps.
The total is additive, so the shortest-path search is exact; for Partial-free
sources it equals the summed lower bound, which forces every rank onto its own
bound. Partial sources are reduced on the source placement (innermost mesh
axis first when ops differ) before data crosses to another placement.
"""
from .cost import lower_bound, priced_bytes
from .execute import all_reduce_key, bucket_key, convert_local, execute, execute_many, execute_many_start
from .route import RankExchange, Route, Step
from .search import route

__all__ = ["route", "Route", "Step", "RankExchange", "execute", "execute_many", "execute_many_start", "all_reduce_key", "bucket_key", "convert_local",
           "lower_bound", "priced_bytes"]
