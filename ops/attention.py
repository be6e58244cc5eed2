"""scaled_dot_product_attention's CPU kernels (+ backward) over any layout of q, k, v.

q, k, v are [batch, heads, seq, head_dim] (k, v may have fewer heads: GQA);
a mask broadcasts like a pointwise operand of [batch, heads, q_seq, k_seq].
Batch and heads split for free. A sequence split has three answers, and the
cost model picks among them unless the user names one (`attention_method`):

- "ulysses": the dispatcher converts q, k, v from S(seq) to S(heads) (one
  all-to-all each) and runs the heads split; needs the heads to divide the
  axis (else ranks sit idle), which "auto" requires and forcing checks.
- "allgather": q stays split, k and v are gathered whole, their gradients
  reduce-scattered back (Megatron's context parallelism). Causal too, for
  self-attention: the kernel's own causal mask does not know where a rank's
  queries start, so the kernel runs unmasked with the mask of its rows
  (query at global row i sees keys 0..i), bit for bit one device's rows.
  "auto" leaves causal to the ring: with the keys gathered rank r does
  (2r+1)/n^2 of the work and holds every key.
- "ring": q, k, v all stay split and k/v blocks travel around the ring
  (`ops/ring_attention.py`), forward and backward, causal or not; its traffic
  is charged by `kernel_cost`, since its inputs need no conversion. At the
  all-gather's bytes it wins (no rank holds the whole keys).

Dropout never reaches these kernels on CPU. The flash kernel refuses
dropout, so torch's composite `scaled_dot_product_attention` (C++, before a
tensor subclass sees anything) takes its math decomposition: bmm, softmax,
`empty_like(attn).bernoulli_(1 - p)` over the whole [B, H, L, S] matrix, div,
mul, bmm. Each runs by its own rule: on a sequence split the queries stay
split, k and v are gathered, and the mask is drawn at global size on every
rank and sliced (`ops/random.py`); output, gradients and the generator after
it equal one device's (tested), forced method or not. Why no ring or Ulysses
runs it (measured on this project's machine, torch 2.13, AMD EPYC):

- The call: only `__torch_function__` (GlobalTensor's) sees the attention
  whole; the dispatcher sees the decomposed ops.
- The mask: torch's CPU `bernoulli_(p)` here draws element i of the
  row-major mask from the generator's mt19937 in order (as a double uniform
  does, two 32-bit words each; chunked draws equal one draw), and a CPU
  generator cannot skip ahead, so a rank reaches its rows only by drawing
  every element before them: B*H*L*S draws per rank whatever n (12 ns each:
  13 s at 16k tokens and 4 heads, 13% of one device's time at 4k, so 1.13x
  of one device / 2 at n = 2 and ~1.9x at n = 8 from the draws alone). With
  MKL on Intel CPUs torch instead seeds one MCG31 stream per call and skips
  it ahead per thread chunk: a chunked draw differs there, and only the
  global-size draw (or MKL's generator re-implemented, untestable here)
  reproduces it.
- The kernel: the flash kernels take no mask, so a ring would run its own
  blockwise math forward and backward (exp(s - lse) * mask / (1 - p) per
  block; the merge by log-sum-exp stays exact, the mask acting after the
  normalisation) and keep each rank's mask rows for the backward.
Each is possible; together they move the all-gather's bytes (n - 1 blocks of
k and v either way) and pay draws that do not shrink with n, so dropout keeps
the decomposition.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from ..layout import Layout
from ..sbp import Split
from .registry import B, P, Ctx, ShardSite, S, Rule, aten, pointwise_dims, register, split_on
from .ring_attention import ring_axes, ring_backward, ring_forward, ring_recv_bytes

METHODS = ("auto", "ring", "ulysses", "allgather")


class _Method(threading.local):
    name: str = "auto"  # a class default: reading it never raises (every dispatch of attention reads it)


_method = _Method()


class attention_method:
    """How attention over a sequence split runs: "ring", "ulysses", "allgather" or "auto" (by cost).

    Called, it sets the method for this rank (per thread, as a simulated rank is one), as
    `torch.set_grad_enabled` does; in a `with` block the previous method returns at its end. The
    backward's kernel is decided when autograd runs it: keep the method set through `backward()`.
    Forcing a method excludes the other two for a sequence split; batch and heads splits stay free.
    """

    # opaque to dynamo, which would guard on the thread-local it sets and fail its own check: the method is read
    # when AOTAutograd traces, so it is set outside the compiled function (the error under fullgraph=True)
    @torch.compiler.disable(reason="gt.attention_method: set it outside the compiled function (it is read when "
                            "AOTAutograd traces the program)")
    def __init__(self, method: str) -> None:
        if method not in METHODS:
            raise ValueError(f"attention_method: {method!r} is not one of {', '.join(map(repr, METHODS))}")
        self.previous, _method.name = _method.name, method

    def __enter__(self) -> "attention_method":
        return self

    @torch.compiler.disable
    def __exit__(self, *exc: Any) -> None:
        _method.name = self.previous


def current_attention_method() -> str:
    return _method.name


def attention_signatures(backward: bool):
    def signatures(ctx: Ctx) -> list:
        off = 1 if backward else 0  # backward inputs: grad_out, q, k, v, out, logsumexp[, mask]
        q, k = ctx.shapes[off], ctx.shapes[off + 1]
        n_main = 6 if backward else 3
        has_mask = len(ctx.shapes) > n_main
        n_out = 3 if backward else 2
        dropout_p = ctx.arg(3 + (3 if backward else 0), "dropout_p", 0.0)
        causal = ctx.arg(4 + (3 if backward else 0), "is_causal", False)
        if dropout_p:
            return []  # the CPU kernel refuses dropout (the module's text): the replicated call raises as one device's
        full = tuple(q[:-1]) + (k[-2],)
        sigs = []
        for d in (0, 1):
            mask = (pointwise_dims(ctx.shapes[-1], full, d),) if has_mask else ()
            sigs.append(((S(d),) * n_main + mask, (S(d),) * n_out))
        if not causal or (not has_mask and q[2] == k[2]):  # all-gather of k, v; their gradients are partial
            # sums over the query blocks (causal: the rows' mask, `_local`)
            mask = (pointwise_dims(ctx.shapes[-1], full, 2),) if has_mask else ()
            sigs.append((((S(2),) if backward else ()) + (S(2), B, B) + ((S(2), S(2)) if backward else ()) + mask,
                         (S(2), P, P) if backward else (S(2), S(2))))
        if not has_mask and (not causal or q[2] == k[2]):  # the ring: causal needs q and k to share the split
            sigs.append(((S(2),) * n_main, (S(2),) * n_out))
        return sigs
    return signatures


def skip_empty(func, args, kwargs, where):
    """The CPU flash kernels divide by zero on an empty shard (uneven heads/batch): answer with zeros."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if all(t.numel() for t in tensors) or any(t.device.type == "meta" for t in tensors):
        return func(*args, **kwargs)
    meta = [torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a for a in args]
    mkw = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
           for k, v in kwargs.items()}
    return tuple(tensors[0].new_zeros(o.shape, dtype=o.dtype) for o in func(*meta, **mkw))


def _scalar_key(backward: bool):
    """What the signatures and the cost read besides shapes: whether dropout is on (not p) and the method."""
    i = 3 + (3 if backward else 0)
    return lambda args, kwargs: (bool(args[i] if len(args) > i else kwargs.get("dropout_p", 0.0)), _method.name)


def _local(backward: bool):
    """The ring's kernel where the keys are split on the sequence, else the kernel on its shards."""
    ring, k_slot = (ring_backward, 2) if backward else (ring_forward, 1)

    def local(func: Any, args: tuple, kwargs: dict, where: ShardSite) -> Any:
        if ring_axes(where.in_layouts[k_slot]):
            return ring(func, args, kwargs, where)
        if where.ctx.arg(causal_at, "is_causal", False):
            start, rows = where.in_box(k_slot - 1)[2]
            if (start, rows) != (0, where.ctx.shapes[k_slot][2]):  # this rank's queries, all the keys
                args, kwargs = _rows_causal(args, kwargs, causal_at, start, rows, args[k_slot])
        return skip_empty(func, args, kwargs, where)
    causal_at = 7 if backward else 4
    return local


def _rows_causal(args: tuple, kwargs: dict, causal_at: int, start: int, rows: int, keys: torch.Tensor) -> tuple:
    """The call on queries start..start+rows of a causal self-attention with all the keys: unmasked by
    the kernel, masked by the rows' own causal mask (an additive -inf above the shifted diagonal)."""
    n = keys.shape[2]
    above = torch.arange(n, device=keys.device)[None, :] > torch.arange(start, start + rows, device=keys.device)[:, None]
    mask = torch.zeros(rows, n, dtype=keys.dtype, device=keys.device).masked_fill_(above, float("-inf"))
    if len(args) > causal_at:
        args = args[:causal_at] + (False,) + args[causal_at + 1:]
    else:
        kwargs = {**kwargs, "is_causal": False}
    return args, {**kwargs, "attn_mask": mask}


def _sequence_cost(backward: bool):
    """The method's rules and the ring's own traffic, for `Rule.kernel_cost`.

    Per mesh axis a choice is the ring (q and k split on the sequence), the all-gather of k/v (q
    split, k whole), Ulysses (an input split on the sequence converted into a heads split), or
    something else (batch, replicated). A forced method is the only one taken on an axis that splits
    the sequence (or, where it cannot be, the replicated run: correct, and visibly costly), and the
    others are taken nowhere; "auto" excludes moving the sequence split into an uneven heads or batch
    split (ranks idle), and the replicated run unless no method can run.
    The ring is charged what it receives, with no latency term: its steps overlap the blocks' compute.
    """
    off = 1 if backward else 0

    def cost(ctx: Ctx, sources: tuple, targets: tuple, out_layouts: tuple) -> Optional[tuple]:
        method = _method.name
        q, k = targets[off], targets[off + 1]
        qkv_sources = sources[off:off + 3]
        if method == "ulysses":
            _check_ulysses(ctx, qkv_sources, off)
        offered = _offered(ctx, backward, qkv_sources)
        # gathering a split sequence (every rank holds and computes all of it) is only the last resort
        gather_ok = not offered if method == "auto" else method not in offered
        kinds = []
        for a, s in enumerate(q.sbp):
            on_seq = any(src.sbp[a] == Split(2) for src in qkv_sources)
            kind = ("ring" if k.sbp[a] == Split(2) else "allgather") if s == Split(2) else \
                "ulysses" if s == Split(1) and on_seq else "replicated" if s == B else "other"
            if on_seq and kind == "replicated" and not gather_ok:
                return None
            if method != "auto" and (kind not in (method, "replicated") if on_seq else kind in ("ring", "allgather")):
                return None
            kinds.append(kind)
        if "ring" in kinds and "allgather" in kinds:
            return None  # the ring runs on whole key blocks of its members
        if method == "auto" and "allgather" in kinds and ctx.arg(4 + 3 * off, "is_causal", False):
            return None  # causal: the ring, unless forced (gathered keys: rank r does (2r+1)/n^2 of the work)
        if not _heads_aligned(q, k, ctx.shapes[off], ctx.shapes[off + 1]):
            return None
        if method == "auto" and ("ulysses" in kinds or "other" in kinds) and any(
                src.sbp != t.sbp for src, t in zip(qkv_sources, targets[off:off + 3])) and not (
                _even(q, ctx.shapes[off]) and _even(k, ctx.shapes[off + 1])):
            return None  # moving a sequence split into heads or batch that leave ranks idle
        if "ring" not in kinds:
            return (), 0
        kt, vt = ctx.args[off + 1], ctx.args[off + 2]
        return ring_recv_bytes(k, targets[off + 2], tuple(kt.shape), tuple(vt.shape), kt.dtype.itemsize,
                               backward), 0
    return cost


def _offered(ctx: Ctx, backward: bool, sources: tuple) -> set:
    """The sequence methods this call can take (as the signatures offer them; Ulysses where the heads
    divide every axis that splits the sequence)."""
    off, n_main = (1, 6) if backward else (0, 3)
    if ctx.arg(3 + (3 if backward else 0), "dropout_p", 0.0):
        return set()
    causal = ctx.arg(4 + (3 if backward else 0), "is_causal", False)
    has_mask = len(ctx.shapes) > n_main
    offered = set()
    if not causal or (not has_mask and ctx.shapes[off][2] == ctx.shapes[off + 1][2]):
        offered.add("allgather")
    if not has_mask and (not causal or ctx.shapes[off][2] == ctx.shapes[off + 1][2]):
        offered.add("ring")
    if _ulysses_divides(ctx, sources, off) is None:
        offered.add("ulysses")
    return offered


def _heads_aligned(q: Layout, k: Layout, q_shape: tuple, k_shape: tuple) -> bool:
    """Whether every rank's query heads use exactly its key/value heads (GQA: query head h reads
    key head h // group), so that the kernel on the shards pairs them as on one device."""
    group = q_shape[1] // k_shape[1]
    for r in q.placement.flat_ranks:
        (qa, qn), (ka, kn) = q.shard(q_shape, r)[1], k.shard(k_shape, r)[1]
        if qn and (qa, qn) != (ka * group, kn * group):
            return False
    return True


def _even(layout: Layout, shape: tuple) -> bool:
    return len(set(layout.local_shapes(shape))) == 1


def _ulysses_divides(ctx: Ctx, sources: tuple, off: int) -> Optional[str]:
    """None where every mesh axis splitting the sequence divides the heads a rank holds; else why not."""
    for a, size in enumerate(ctx.mesh):
        if not any(src.sbp[a] == Split(2) for src in sources):
            continue
        for name, src, shape in (("query", sources[0], ctx.shapes[off]),
                                 ("key/value", sources[1], ctx.shapes[off + 1])):
            heads = max(s[1] for s in src.local_shapes(shape))
            if heads % size:
                return (f"the {name} has {heads} heads per rank, not divisible by {size}, the size of mesh "
                        f"axis {a} that splits the sequence (Ulysses gives each rank heads/{size} of them)")
    return None


def _rows_whole(ctx: Ctx, ins: tuple, outs: tuple) -> bool:
    """The hook is the kernel itself where no input is split on the sequence (dim 2): no ring, every rank's
    queries start at row 0; and without dropout, whose mask is drawn per shard (`Rule.plain_when`)."""
    return not ctx.named("dropout_p", 0.0) and not any(lay is not None and split_on(lay, 2) for lay in ins)


def _check_ulysses(ctx: Ctx, sources: tuple, off: int) -> None:
    """Forced Ulysses with heads the sequence's axis does not divide: say so, and what works."""
    why = _ulysses_divides(ctx, sources, off)
    if why is not None:
        raise ValueError(f"attention_method('ulysses'): {why}; use gt.attention_method('ring') or 'allgather', "
                         "or 'auto'")


for _backward, _op in ((False, aten._scaled_dot_product_flash_attention_for_cpu.default),
                       (True, aten._scaled_dot_product_flash_attention_for_cpu_backward.default)):
    register([_op], Rule(attention_signatures(_backward), kernel=_local(_backward),
                         scalar_key=_scalar_key(_backward), kernel_cost=_sequence_cost(_backward),
                         keep_converted_inputs=not _backward, plain_when=_rows_whole))
