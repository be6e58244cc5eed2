"""For tests: what the dispatcher chose for a call, and what every valid choice would have cost."""
from __future__ import annotations

import itertools
import math

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.ops import decide, dispatch
from globaltensor.ops.registry import RULES, Ctx


def decision_for(func, args, kwargs=None):
    return dispatch.decision_of(func, args, kwargs, gt.GlobalTensor)


def _setup(func, args, kwargs):
    kwargs = kwargs or {}
    tensors: list = []
    decide.map_tensors(args, kwargs, lambda t, i: tensors.append(t))
    placement = decide.placement_of(func, tensors, gt.GlobalTensor)
    bcast = Layout(placement, (gt.broadcast,) * placement.ndim)
    srcs = tuple(t._layout if isinstance(t, gt.GlobalTensor) else bcast for t in tensors)
    metas, mkw = decide.map_tensors(args, kwargs, lambda t, i: decide.meta_like(t, t.shape))
    outs, _ = decide.flatten_out(func(*metas, **mkw))
    ctx = Ctx(func, tuple(tuple(t.shape) for t in tensors),
              tuple(None if o is None else tuple(o.shape) for o in outs), args, kwargs, placement.shape)
    return ctx, placement, srcs, tensors, outs


def cost_of(dec, func, args, kwargs=None):
    """The full cost (input boxing + what the outputs owe) of the decision taken."""
    ctx, _, srcs, tensors, outs = _setup(func, args, kwargs)
    return decide.signature_cost(ctx, srcs, tensors, dec.targets, dec.out_layouts, outs, dec.inplace)


def candidates_cost(func, args, kwargs=None):
    """Every valid nd signature's (cost, input layouts), cheapest first."""
    ctx, placement, srcs, tensors, outs = _setup(func, args, kwargs)
    rule = RULES[func]
    inplace = decide.is_inplace(func)
    cands = decide.axis_candidates(ctx, rule, len(tensors), len(outs))
    result = []
    for combo in itertools.product(*[cands] * placement.ndim):
        targets = tuple(Layout(placement, tuple(sig[0][i] for sig in combo)) for i in range(len(tensors)))
        out_layouts = tuple(None if outs[j] is None else Layout(placement, tuple(sig[1][j] for sig in combo))
                            for j in range(len(outs)))
        if not decide.valid(ctx, rule, targets, out_layouts, placement):
            continue
        cost = decide.signature_cost(ctx, srcs, tensors, targets, out_layouts, outs, inplace)
        if cost[0] != float("inf"):
            result.append((cost, targets))
    return sorted(result, key=lambda r: r[0])


def chosen_is_cheapest(func, make_args, mesh, placement_of_mesh):
    """(chosen cost, cheapest valid cost, number of candidates) of `func(*make_args(placement))` on rank 0."""
    def body():
        args = make_args(placement_of_mesh(mesh))
        func(*args)
        dec = decision_for(func, args)
        cands = candidates_cost(func, args)
        return cost_of(dec, func, args)[0], cands[0][0][0], len(cands)
    return gt.launch(body, math.prod(mesh))[0]
