"""Pointwise and broadcasting ops: any output dim may be split; Partial passes only through linear slots.

`LINEAR` lists, per op, the groups of tensor inputs in which the op is
linear *jointly* (add: both operands together; mul: either one alone with
the other Broadcast). Every other pointwise op is nonlinear and never sees P.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .device import device_changes, move_device
from .inputs import unsettle
from .registry import (PMAX, PMIN, B, RULES, Ctx, P, Rule, S, aten, aten_overloads, is_inplace, overloads,
                       pointwise_dims, register, writes_out)

_PROTOTYPES: dict = {}  # (op, what type promotion reads of its args) -> its outputs on one-element stand-ins


def _promotion_key(a: Any) -> Any:
    """What an elementwise op's output dtypes can depend on: dtypes, 0-dim-ness, Python number types."""
    if isinstance(a, torch.Tensor):
        return (torch.Tensor, a.dtype, a.dim())
    if isinstance(a, (bool, int, float, complex)):
        return type(a)
    if isinstance(a, (list, tuple)):
        return (type(a),) + tuple(_promotion_key(x) for x in a)
    return a


def _standin(a: Any) -> Any:
    return torch.empty((1,) * a.dim(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a


def elementwise_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """The op's outputs on meta tensors without its meta kernel (a Python reference, ~0.1 ms a call).

    Shapes are the broadcast of the tensor inputs (an in-place op must keep
    its own); dtypes are what the op gives one-element stand-ins, remembered
    per `_promotion_key`: type promotion never reads sizes or values.
    """
    key = (func, _promotion_key(args), _promotion_key(tuple(sorted(kwargs.items()))))
    proto = _PROTOTYPES.get(key)
    if proto is None:
        proto = _PROTOTYPES[key] = func(*map(_standin, args), **{k: _standin(v) for k, v in kwargs.items()})
    shapes = [a.shape for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    shape = shapes[0]
    for other in shapes[1:]:
        shape = torch._C._infer_size(shape, other)  # raises as the op would; broadcast_shapes costs 10 µs
    if is_inplace(func) and shape != shapes[0]:
        raise RuntimeError(f"{func}: in-place output of shape {tuple(shapes[0])} does not broadcast to {tuple(shape)}")

    def full(o: Any) -> Any:
        return torch.empty(shape, dtype=o.dtype, device="meta") if isinstance(o, torch.Tensor) else o
    return type(proto)(map(full, proto)) if isinstance(proto, (tuple, list)) else full(proto)


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


def _fill_value_key(args: tuple, kwargs: dict) -> bool:
    """masked_fill's decision reads whether its fill is zero (a Partial may pass then)."""
    v = args[2] if len(args) > 2 else kwargs.get("value")
    return not hasattr(v, "shape") and v == 0


def linear(groups: tuple, when: Optional[Callable[[Ctx], bool]] = None, overwrites: bool = False,
           scalar_key: Optional[Callable[[tuple, dict], Any]] = None) -> Rule:
    def signatures(ctx: Ctx) -> list:
        sigs = split_signatures(ctx)
        if when is None or when(ctx):
            n = len(ctx.shapes)
            for g in groups:
                if max(g) < n:
                    sigs.append((tuple(P if i in g else B for i in range(n)), (P,) * len(ctx.out_shapes)))
        return sigs
    return Rule(signatures, overwrites=overwrites, meta=elementwise_meta, scalar_key=scalar_key)


NONLINEAR = Rule(split_signatures, meta=elementwise_meta)


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
    ("neg", "clone", "alias", "detach", "zero", "positive", "real", "conj_physical",
     "lift_fresh"): linear(((0,),)),
    ("copy",): linear(((0, 1),), overwrites=True),
    ("lerp",): linear(((0, 1),)),
    ("where",): linear(((1, 2),)),
    ("masked_fill",): linear(((0,),), _fills_zero, scalar_key=_fill_value_key),
    ("addcmul",): linear(((0, 1), (0, 2))),
    ("addcdiv",): linear(((0, 1),)),
    ("true_divide",): linear(((0,),)),
    ("deg2rad", "rad2deg"): linear(((0,),)),
    # backward kernels of activations: linear in the incoming gradient
    ("threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
     "hardswish_backward", "hardsigmoid_backward", "hardshrink_backward", "softshrink_backward", "mish_backward",
     "logit_backward", "native_dropout_backward"): linear(((0,),)),
}
NONLINEAR_OPS = (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu",
    "pow", "abs", "sin", "cos", "erf", "reciprocal", "sign", "floor", "ceil", "round", "trunc", "rsub",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_not",
    "bitwise_and", "bitwise_or", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "isnan", "isinf",
    "fill", "hardtanh", "leaky_relu", "elu", "softplus", "mish", "square", "nan_to_num", "sgn", "atan2",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "floor_divide", "remainder", "fmod", "bitwise_xor", "logical_xor",
)

NONLINEAR_UNTAGGED = ("hardswish",)  # elementwise, but torch does not tag them pointwise

for names, rule in LINEAR.items():
    register(_ops(*names), rule)
register(_ops(*NONLINEAR_OPS, *NONLINEAR_UNTAGGED), NONLINEAR)


class _CompileOnly:
    registered = False


def register_compile_only() -> None:
    """Rules for ops only dynamo emits: its decompositions turn `addcmul_(a, b, value=v)` (AdamW's second
    moment) into `mul` and `prims.fma(a * b, v, self)`, an op `torch._inductor` defines, whose import would
    cost every program half a second. Registered when a GlobalTensor is first flattened for tracing."""
    if _CompileOnly.registered:
        return
    from torch._inductor import inductor_prims
    register([inductor_prims.fma], NONLINEAR)  # x * y + z, elementwise
    _CompileOnly.registered = True
# every other op torch tags pointwise (elementwise with broadcasting), and its in-place form (torch tags
# `copysign` but not `copysign_`): nonlinear unless LINEAR names it; out= overloads are ops/out_variants.py's
def _tagged_pointwise() -> list:
    """The overloads torch tags pointwise, and the same overloads of their in-place packets (only these: `max.other`
    is tagged, `max.dim` is a reduction)."""
    found = []
    for op in aten_overloads():
        if torch.Tag.pointwise not in op.tags or writes_out(op):
            continue
        found.append(op)
        in_place = getattr(aten, op._schema.name.split("::")[1] + "_", None)
        if in_place is not None and op._overloadname in in_place.overloads():
            found.append(getattr(in_place, op._overloadname))
    return found


register([op for op in _tagged_pointwise() if op not in RULES], NONLINEAR)


def zero_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    """`x.zero_()` zeroes the shard, whatever the layout (a zero is Broadcast, split and Partial alike): nothing
    to decide. A gradient its bucket reduced in place takes back its backward's layout first (`unsettle`:
    `zero_grad(set_to_none=False)` then keeps the next step's gradients bucketed)."""
    x = args[0]
    unsettle(x)
    x._local.zero_()
    return x


register([aten.zero_.default], Rule(lambda ctx: [], decompose=zero_in_place))


# -- casts (`.float()`, `.to(dtype)`, `type_as`) and queries of the shard ---------------------------
def partials_kept(src: torch.dtype, dst: torch.dtype) -> list:
    """The Partials a cast from `src` to `dst` keeps.

    Sum where the cast is linear up to rounding: to a floating or complex dtype, from anything but
    bool. Max and min where it is monotone and keeps the identity of an empty shard (-inf, inf): to
    a floating dtype from a real one. A cast of P(sum) to an integer dtype would truncate each
    rank's part (1.5 + 1.5 -> 1 + 1), and a cast to bool is neither linear nor monotone.
    """
    kept = []
    if (dst.is_floating_point or dst.is_complex) and src != torch.bool:
        kept.append(P)
    if dst.is_floating_point and not src.is_complex:
        kept += [PMAX, PMIN]
    return kept


def cast_signatures(ctx: Ctx) -> list:
    x = ctx.args[0]
    dst = ctx.kwargs.get("dtype") or x.dtype
    return split_signatures(ctx) + [((p,), (p,)) for p in partials_kept(x.dtype, dst)]


def cast_meta(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """`_to_copy` on meta: the dtype asked for, the input's shape and, as torch's kernel lays it out, the memory
    format asked for (preserved by default: a transposed input gives a transposed copy); a `device=` asked for is
    the shard's business."""
    x = args[0]
    return torch.empty_like(x, dtype=kwargs.get("dtype") or x.dtype, device="meta",
                            memory_format=kwargs.get("memory_format") or torch.preserve_format)


def any_layout_no_output(ctx: Ctx) -> list:
    """An op that answers a Python value about the local shard (`is_pinned`): every layout as it is."""
    return [((s,), ()) for s in [S(d) for d in range(len(ctx.shapes[0]))] + [P, PMAX, PMIN]]


def cast_local(func: Any, args: tuple, kwargs: dict, where: Any) -> torch.Tensor:
    """`_to_copy` of the shard; a `device=` of the placement's own type (another is `move_device`'s) keeps a dry
    run's meta shard on meta: its wrapper reports the placement's type, which `.to(x.device)` then asks for."""
    if kwargs.get("device") is not None and args[0].is_meta:
        kwargs = {**kwargs, "device": args[0].device}
    return func(*args, **kwargs)


register([aten._to_copy.default], Rule(cast_signatures, meta=cast_meta, decompose=move_device,
                                       decompose_when=device_changes, kernel=cast_local,
                                       plain_when=lambda ctx, sources, targets: True))
register([aten.is_pinned.default], Rule(any_layout_no_output))
