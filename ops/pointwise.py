"""Pointwise and broadcasting ops: any output dim may be split; Partial passes only through linear slots.

`LINEAR` lists, per op, the groups of tensor inputs in which the op is
linear *jointly* (add: both operands together; mul: either one alone with
the other Broadcast). Every other pointwise op is nonlinear and never sees P.
"""
from __future__ import annotations

from typing import Callable, Optional

from .registry import B, Ctx, P, Rule, S, aten, overloads, pointwise_dims, register


def split_signatures(ctx: Ctx) -> list:
    """S(d) of the output <- the matching dim of every input that has it (size-1 dims stay B)."""
    out = ctx.out_shapes[0]
    n_out = len(ctx.out_shapes)
    return [(tuple(pointwise_dims(s, out, d) for s in ctx.shapes), (S(d),) * n_out) for d in range(len(out))]


def _all_tensor_operands(ctx: Ctx) -> bool:
    """add/sub are linear only when no Python number is added (x + 1 on a P tensor would add it n times)."""
    return len(ctx.shapes) >= 2


def _fills_zero(ctx: Ctx) -> bool:
    v = ctx.arg(2, "value")
    return not hasattr(v, "shape") and v == 0


def linear(groups: tuple, when: Optional[Callable[[Ctx], bool]] = None, overwrites: bool = False) -> Rule:
    def signatures(ctx: Ctx) -> list:
        sigs = split_signatures(ctx)
        if when is None or when(ctx):
            n = len(ctx.shapes)
            for g in groups:
                if max(g) < n:
                    sigs.append((tuple(P if i in g else B for i in range(n)), (P,) * len(ctx.out_shapes)))
        return sigs
    return Rule(signatures, overwrites=overwrites)


NONLINEAR = Rule(split_signatures)


def _ops(*names: str) -> list:
    """Every overload of the named packets (and their in-place forms), except out= variants."""
    found = []
    for packet in overloads(*names, *(n + "_" for n in names)):
        found += [getattr(packet, o) for o in packet.overloads() if "out" not in o]
    return found


LINEAR = {
    ("add", "sub"): linear(((0, 1),), _all_tensor_operands),
    ("mul",): linear(((0,), (1,))),
    ("div",): linear(((0,),)),
    ("neg", "clone", "_to_copy", "alias", "detach", "zero", "positive", "real", "conj_physical",
     "lift_fresh"): linear(((0,),)),
    ("copy",): linear(((0, 1),), overwrites=True),
    ("lerp",): linear(((0, 1),)),
    ("where",): linear(((1, 2),)),
    ("masked_fill",): linear(((0,),), _fills_zero),
    ("addcmul",): linear(((0, 1), (0, 2))),
    ("addcdiv",): linear(((0, 1),)),
    ("threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward"):
        linear(((0,),)),
}
NONLINEAR_OPS = (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu",
    "pow", "abs", "sin", "cos", "erf", "reciprocal", "sign", "floor", "ceil", "round", "trunc", "rsub",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_not",
    "bitwise_and", "bitwise_or", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "isnan", "isinf",
    "fill", "hardtanh", "leaky_relu", "elu", "softplus", "mish", "square", "nan_to_num", "sgn", "atan2",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
)

for names, rule in LINEAR.items():
    register(_ops(*names), rule)
register(_ops(*NONLINEAR_OPS), NONLINEAR)
