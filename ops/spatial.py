"""Pools, upsampling, padding, im2col/col2im, pixel and channel shuffles, grid sampling, GLU and PReLU.

Each of these maps every (batch, channel) plane on its own: a pool, an upsampling or a pad reads only
the spatial dims of the plane it writes, so the leading (batch and channel) dims may be split and the
spatial dims are taken whole (a window or an interpolation crossing a shard border would need the
neighbour's rows). Where the op mixes channels (pixel shuffle folds channels into space, im2col
unfolds each channel into kernel-size rows) only the batch dims are carried. Max pools' indices are
flat offsets inside one plane, so they stay right on a split of the planes.

Sizes in the arguments are global where they name the input (an upsampling backward's `input_size`):
those kernels take this rank's. A torch kernel that refuses an empty shard ("non-empty 4D tensor
expected") is not called on one: an empty input plane gives an empty output (`empty_safe`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .dims import carried, leading
from .registry import B, Ctx, P, Rule, S, ShardSite, always, overloads, pointwise_dims, register


def _empties(where: ShardSite, device: torch.device, meta: Optional[Callable] = None) -> Any:
    """The outputs as empty shards where every output shard of this rank is empty (else None): the op on the
    global meta arguments (which the decision already ran) says their dtypes and how they are returned."""
    if any(lay is not None and 0 not in where.out_shape(i) for i, lay in enumerate(where.out_layouts)):
        return None
    ctx = where.ctx
    out = meta(ctx.func, ctx.args, ctx.kwargs) if meta is not None else ctx.func(*ctx.args, **ctx.kwargs)
    if isinstance(out, torch.Tensor):
        return torch.empty(where.out_shape(0), dtype=out.dtype, device=device)
    return type(out)(None if o is None else torch.empty(where.out_shape(i), dtype=o.dtype, device=device)
                     for i, o in enumerate(out))


def empty_safe(local: Optional[Callable] = None, meta: Optional[Callable] = None) -> Callable:
    """A kernel that runs `local` (default: the op) on the shards, except where one input shard is empty
    (a split of a dim shorter than the mesh): then every output shard is empty too, and made so without
    calling torch, whose kernels refuse an empty channel or spatial dim. `meta` stands in for an op that
    torch gives no meta kernel, when the dispatcher checks a choice on meta shards."""
    def kernel(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
        if meta is not None and where.checking:
            return meta(func, args, kwargs)
        if any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in (*args, *kwargs.values())):
            out = _empties(where, next(a.device for a in args if isinstance(a, torch.Tensor)), meta)
            if out is not None:
                return out
        return func(*args, **kwargs) if local is None else local(func, args, kwargs, where)
    return kernel


def planes(spatial: int, whole: int = 0) -> Callable[[Ctx], int]:
    """How many leading dims an op of `spatial` trailing spatial dims carries (batch and channel dims):
    the first tensor's dims less the spatial ones, less `whole` more that the op mixes (channels)."""
    return lambda ctx: max(len(ctx.shapes[0]) - spatial - whole, 0)


def per_plane(spatial: int, whole: int = 0, local: Optional[Callable] = None, meta: Optional[Callable] = None) -> Rule:
    """The leading dims of every tensor input and output carried alike, the rest whole."""
    return carried(leading(planes(spatial, whole)), kernel=empty_safe(local, meta), plain_when=always, meta=meta)


def like_self(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """A pool backward's output on meta: the input's (`self`, after the gradient) shape and dtype."""
    return torch.empty_like(args[1], device="meta")


def _packets(*names: str) -> list:
    """Every overload of the named packets, except out= ones (ops/out_variants.py takes those)."""
    return [getattr(p, o) for p in overloads(*names) for o in p.overloads() if "out" not in o]


def _scales_key(args: tuple, kwargs: dict) -> tuple:
    """The float scale factors of an upsampling: `.vec` overloads take the output size from them, so a
    decision (output shapes) reads them; the cache keys on them (floats otherwise key as "a float")."""
    return tuple(a if not isinstance(a, list) else tuple(a) for a in (*args, *kwargs.values())
                 if isinstance(a, float) or (isinstance(a, list) and a and isinstance(a[0], float)))


# -- pools, pads, upsampling, unpooling: (batch and) channel dims carried ---------------------------------
for _spatial, _names in {
    1: ("reflection_pad1d", "reflection_pad1d_backward", "replication_pad1d", "replication_pad1d_backward"),
    2: ("avg_pool2d", "avg_pool2d_backward", "max_pool2d_with_indices", "max_pool2d_with_indices_backward",
        "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "adaptive_max_pool2d",
        "adaptive_max_pool2d_backward", "fractional_max_pool2d_backward", "max_unpool2d",
        "reflection_pad2d", "reflection_pad2d_backward", "replication_pad2d", "replication_pad2d_backward"),
    3: ("avg_pool3d", "avg_pool3d_backward", "max_pool3d_with_indices", "max_pool3d_with_indices_backward",
        "_adaptive_avg_pool3d", "_adaptive_avg_pool3d_backward", "adaptive_max_pool3d",
        "adaptive_max_pool3d_backward", "max_unpool3d",
        "reflection_pad3d", "reflection_pad3d_backward", "replication_pad3d", "replication_pad3d_backward"),
}.items():
    register(_packets(*_names), per_plane(_spatial))
register(_packets("fractional_max_pool3d_backward"), per_plane(3, meta=like_self))  # torch has no meta kernel


UPSAMPLE = {1: ("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_linear1d"),
            2: ("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
                "upsample_bicubic2d", "_upsample_bicubic2d_aa"),
            3: ("upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_trilinear3d")}


def upsample_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """`input_size` names the whole input ([N, C, *spatial]): this rank's gradient shard is its planes."""
    named = {a.name: i for i, a in enumerate(func._schema.arguments)}
    size = list(where.out_shape(0))
    i = named["input_size"]
    if i < len(args):
        args = args[:i] + (size,) + args[i + 1:]
    else:
        kwargs = {**kwargs, "input_size": size}
    return func(*args, **kwargs)


for _spatial, _names in UPSAMPLE.items():
    register(_packets(*_names), Rule(per_plane(_spatial).signatures, kernel=empty_safe(), plain_when=always,
                                      scalar_key=_scales_key))
    register(_packets(*(n + "_backward" for n in _names)),
             Rule(per_plane(_spatial).signatures, kernel=empty_safe(upsample_backward_local), plain_when=always,
                  scalar_key=_scales_key))


# -- fractional max pool: the random samples [N, C, 2] are per plane too --------------------------------
def fractional_dims(spatial: int) -> Callable[[Ctx], list]:
    """input [(N,) C, *spatial], samples [N or 1, C, 2]: N and C carried to both outputs."""
    def dims(ctx: Ctx) -> list:
        nd = len(ctx.shapes[0])
        lead = nd - spatial
        found = []
        for d in range(lead):
            sd = d + (2 - lead)  # the samples' dim: C is always dim 1, N dim 0 when the input has one
            found.append(((d, sd if sd >= 0 and ctx.shapes[1][sd] == ctx.shapes[0][d] else None), (d, d)))
        return found
    return dims


register(_packets("fractional_max_pool2d"), carried(fractional_dims(2), kernel=empty_safe(), plain_when=always))
register(_packets("fractional_max_pool3d"), carried(fractional_dims(3), kernel=empty_safe(), plain_when=always))


# -- ops that mix channels: batch dims only ------------------------------------------------------------
register(_packets("im2col", "pixel_shuffle", "pixel_unshuffle"), per_plane(2, whole=1))
register(_packets("col2im"), per_plane(1, whole=1))


def channel_shuffle_dims(ctx: Ctx) -> list:
    """[N, C, *]: every dim but the shuffled channels is carried."""
    return [((d,), (d,)) for d in range(len(ctx.shapes[0])) if d != 1]


register(_packets("channel_shuffle", "native_channel_shuffle"),
         carried(channel_shuffle_dims, kernel=empty_safe(), plain_when=always))


# -- grid sampling: input [N, C, *in], grid [N, *out, k] -> [N, C, *out] ---------------------------------
def grid_sampler_signatures(ctx: Ctx) -> list:
    """The batch is carried by input, grid and output; the channels by input and output (grid whole)."""
    return [((S(0), S(0)), (S(0),)), ((S(1), B), (S(1),))]


def grid_sampler_backward_signatures(ctx: Ctx) -> list:
    """(grad_out, input, grid) -> (grad_input, grad_grid): the batch carried; linear in grad_out. A channel
    split is taken only where the grid's gradient is not asked for: each rank would hold its channels'
    share of it (a sum over channels), which differs from one device's sum by rounding (its order)."""
    sigs = [((S(0), S(0), S(0)), (S(0), S(0))), ((P, B, B), (P, P))]
    if not ctx.named("output_mask")[1]:
        sigs.append(((S(1), S(1), B), (S(1), B)))
    return sigs


register(_packets("grid_sampler_2d", "grid_sampler_3d"),
         Rule(grid_sampler_signatures, kernel=empty_safe(), plain_when=always))
def grid_sampler_backward_local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
    """No channels here (a channel split shorter than the mesh): no input gradient, no share of the grid's."""
    x, grid = args[1], args[2]
    if x.shape[1] == 0 and x.shape[0] > 0:
        mask = kwargs.get("output_mask", args[6] if len(args) > 6 else (True, True))
        return (torch.empty(where.out_shape(0), dtype=x.dtype, device=x.device) if mask[0] else None,
                torch.zeros(where.out_shape(1), dtype=grid.dtype, device=grid.device) if mask[1] else None)
    return func(*args, **kwargs)


register(_packets("grid_sampler_2d_backward", "grid_sampler_3d_backward"),
         Rule(grid_sampler_backward_signatures, kernel=empty_safe(grid_sampler_backward_local), plain_when=always))


# -- GLU: halves one dim; every other dim carried ------------------------------------------------------
def glu_dims(ctx: Ctx) -> list:
    nd = len(ctx.shapes[0])
    dim = ctx.named("dim", -1) % max(nd, 1)
    return [((d,) * len(ctx.shapes), (d,)) for d in range(nd) if d != dim]


def glu_backward_signatures(ctx: Ctx) -> list:
    return carried(glu_dims).signatures(ctx) + [((P, B), (P,))]  # linear in the incoming gradient


register(_packets("glu"), carried(glu_dims, kernel=empty_safe(), plain_when=always))
register(_packets("glu_backward"), Rule(glu_backward_signatures, kernel=empty_safe(), plain_when=always))


# -- PReLU: elementwise, the weight broadcast per channel -------------------------------------------------
def prelu_signatures(ctx: Ctx) -> list:
    out = ctx.out_shapes[0]
    return [((S(d), pointwise_dims(ctx.shapes[1], out, d)), (S(d),)) for d in range(len(out))]


def prelu_backward_signatures(ctx: Ctx) -> list:
    """(grad, x, weight) -> (grad_x, grad_weight), both of x's shape (autograd sums the weight's down to its
    shape afterwards): elementwise, as the forward; linear in grad."""
    x, w = ctx.shapes[1], ctx.shapes[2]
    sigs = [((S(d), S(d), pointwise_dims(w, x, d)), (S(d), S(d))) for d in range(len(x))]
    sigs.append(((P, B, B), (P, P)))
    return sigs


register(_packets("_prelu_kernel"), Rule(prelu_signatures, kernel=empty_safe(), plain_when=always))
register(_packets("_prelu_kernel_backward"), Rule(prelu_backward_signatures, kernel=empty_safe(), plain_when=always))
