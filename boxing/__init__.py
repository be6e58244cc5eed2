"""globaltensor.boxing: layouts -> plan (cost, search) -> execution on a Communicator.

    plan = gt.boxing.plan(src_layout, dst_layout, shape, dtype)   # cached, pure data
    plan.steps, plan.recv_bytes, plan.lower_bound, print(plan.explain())
    local = gt.boxing.execute(plan, local, comm)                 # every rank, same order
    locals = gt.boxing.execute_many(plans, locals, comm)         # one collective per bucket of such plans

Cost is the total of bytes received over all ranks (DESIGN.md's convention per
primitive), then latency terms (one per collective; a point-to-point step
counts the most peers one rank talks to), then fewer point-to-point steps.
The total is additive, so the shortest-path search is exact; for Partial-free
sources it equals the summed lower bound, which forces every rank onto its own
bound. Partial sources are reduced on the source placement (innermost mesh
axis first when ops differ) before data crosses to another placement.
"""
from .cost import lower_bound
from .execute import all_reduce_key, bucket_key, convert_local, execute, execute_many, execute_many_start
from .plan import Plan, RankRoute, Step
from .search import plan

__all__ = ["plan", "Plan", "Step", "RankRoute", "execute", "execute_many", "execute_many_start", "all_reduce_key", "bucket_key", "convert_local",
           "lower_bound"]
