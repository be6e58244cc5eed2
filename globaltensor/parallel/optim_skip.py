"""An optimizer step on a rank outside a parameter's placement skips that parameter, as every op does.

A pipeline's optimizer lists every stage's parameters on every rank (one global program), and on a rank
outside a stage those are empty shards with empty gradients. Stepping them computes nothing, yet torch's
per-parameter Python (`_init_group`, a `.item()` per step counter, each foreach list's elements) and the
dispatcher's foreach path pay for each one: a 2-stage GPT's AdamW took 3.6-3.8 ms per rank against
torch.pipelining's 1.8 on its own stage's half. So during `step()` those parameters' gradients are
hidden (`grad = None`, which torch's optimizers skip) and put back after.

What the skipped step would have changed is put right by hand, so each rank's optimizer state is what
the full step leaves: an empty shard's moments stay empty either way, and the per-parameter step
counter (a plain number or tensor, the same on every rank) is advanced. That is all that changes only
for optimizers whose per-parameter state is shards plus that counter: the allow-list below. Others
(NAdam's `mu_product`, ASGD's `eta`, LBFGS's flat view of every parameter, Rprop's masked writes) step
as before. A parameter is skipped only once it has state (its first step makes it on every rank, so
checkpoints hold the same keys everywhere). Nothing crosses parameters inside these optimizers' steps
and their ops are elementwise, so a rank skipping one leaves no collective unmatched: such ops on a
tensor involve only the ranks of its placement (a data-dependent op would not: the ranks outside learn
its output's shape from the ranks inside).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..runtime import context
from ..tensor import GlobalTensor

ENABLED = True  # tests turn it off to compare the states a full step leaves

# per-parameter state: shards and the `step` counter only, and only elementwise ops on them (read in torch
# 2.13's sources; each checked against a full step in tests/test_optim_skip.py, for-loop and foreach). Rprop is not: its
# `grad[sign.eq(etaminus)] = 0` is a data-dependent op, whose output shape the ranks outside the placement
# learn from the ranks inside (a collective they must join).
PER_PARAMETER = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.RAdam, torch.optim.SGD,
                 torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop)

_ELSEWHERE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict]" = weakref.WeakKeyDictionary()


class _Hidden(threading.local):  # simulated ranks are threads of one process
    def __init__(self) -> None:
        self.by_optimizer = {}  # id(optimizer) -> [(parameter, its hidden gradient)]


_HIDDEN = _Hidden()


def _elsewhere(opt: torch.optim.Optimizer, rank: int) -> list:
    """The optimizer's parameters whose placement leaves `rank` out (remembered while its groups keep
    their size: a parameter's placement never changes, `to_global` makes new parameters)."""
    size = sum(len(g["params"]) for g in opt.param_groups)
    per_rank = _ELSEWHERE.get(opt)
    if per_rank is None:
        per_rank = _ELSEWHERE[opt] = {}
    got = per_rank.get(rank)
    if got is None or got[0] != size:
        got = per_rank[rank] = (size, [p for g in opt.param_groups for p in g["params"]
                                       if isinstance(p, GlobalTensor) and rank not in p._layout.placement])
    return got[1]


def _hide(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _restore(opt)  # a step that raised never ran the post hook
    comm = context.current_or_none()
    if not ENABLED or comm is None or type(opt) not in PER_PARAMETER:
        return
    state = opt.state
    hidden = []
    for p in _elsewhere(opt, comm.rank):
        g = p.grad
        if g is not None and p in state:
            hidden.append((p, g))
            p.grad = None
    if hidden:
        _HIDDEN.by_optimizer[id(opt)] = hidden


def _restore(opt: torch.optim.Optimizer) -> list:
    hidden = _HIDDEN.by_optimizer.pop(id(opt), ())
    for p, g in hidden:
        p.grad = g
    return hidden


def _advance(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Post hook: the gradients back, and each skipped parameter's step counter as the step would leave it
    (tensor counters in one foreach add per device and dtype, as torch's optimizers advance theirs)."""
    counters: dict = {}
    for p, _ in _restore(opt):
        st = opt.state[p]
        step = st.get("step")
        if isinstance(step, torch.Tensor):
            counters.setdefault((step.device, step.dtype), []).append(step)
        elif step is not None:
            st["step"] = step + 1
    for steps in counters.values():
        torch._foreach_add_(steps, 1)


_HOOKS = (register_optimizer_step_pre_hook(_hide), register_optimizer_step_post_hook(_advance))
