"""Dropless MoE's ops: rows regrouped by expert, a grouped linear layer per expert, and back.

`by_expert(xs, counts, experts)` takes each routing group's rows sorted by expert (`xs [G, R, d]`,
`counts [G, E]` rows of group g for expert e) to one expert-major tensor `[G * R, d]` (rows ordered
expert, group, slot) and returns it with a `Routing` that the grouped layer and `by_group` (the
inverse) read. On one device both are a stable sort by expert. On global tensors, with the groups
split over the experts' mesh axis (the axis that splits `experts`, a weight `[E, ...]`, on dim 0):

- the count exchange: one all-gather of each rank's `[G_r, E]` counts over the expert axis (small;
  an all-gather rather than Megatron's all-to-all because the ragged result carries every rank's
  size, which is the sum of a column block over all groups);
- one uneven all-to-all of exactly the routed rows (a rank keeps the rows of its own experts);
- the result is ragged (`gt.ragged(0)`) on the expert axis: a rank holds its experts' rows.

A rank's rows arrive as (sender, expert, group) and are put in (expert, sender, group) order by a
local stable sort, so every expert's rows are contiguous: `grouped_linear` runs one matmul per local
expert (`torch._grouped_mm` takes no float64 and wants 16-byte strides on CPU in torch 2.13; the loop
is exact, as the tests need). `by_group` is the same path reversed, and each one's backward is the
other's forward: the backward moves exactly the routed rows' gradients, and no counts.

A mesh axis that splits the expert weights on another dim is a tensor axis (EP x TP, Megatron per
expert): the rows are whole there, `grouped_linear` reads column- or row-parallel off the weight's
split, and the two Partial results each direction has (the second layer's products, the first
layer's input gradient) are reduced once on that axis.

Mesh axes other than the expert axis that also split the groups (EP x DP) make independent slices:
each slice routes its own tokens, the expert-side rows are ragged on those axes too with sizes known
only inside the slice (None), so such a tensor converts only back through `by_group`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .layout import Layout
from .ragged import RaggedTensor, convert, make
from .runtime import context
from .sbp import Broadcast, Partial, Ragged, Split, split_range
from .tensor import GlobalTensor, grad_layout


@dataclass(frozen=True)
class Routing:
    """One step's routing, as this rank needs it: data (counts), not structure, like a ragged size."""
    sort_local: torch.Tensor         # this rank's rows, group-major -> expert-major (a permutation)
    sort_received: torch.Tensor      # received rows, (sender, expert, group) -> (expert, sender, group)
    send: tuple                      # rows sent to each of the peers
    recv: tuple                      # rows received from each of them
    per_expert: tuple                # rows of each local expert, in order (the grouped layer's offsets)
    peers: tuple                     # the ranks of this rank's expert axis group; () on one device
    # the token side's shape (and, global tensors only, its layout), the expert side's layout and sizes
    token_layout: Optional[Layout] = None
    token_shape: tuple = ()
    expert_layout: Optional[Layout] = None
    sizes: Optional[tuple] = None


def _ids(counts: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Expert id of each row when block (i, j) of `counts` holds counts[i, j] rows, blocks row-major."""
    return experts.repeat(counts.shape[0]).repeat_interleave(counts.reshape(-1))


def _expert_axis(experts: GlobalTensor) -> int:
    axes = [a for a, s in enumerate(experts.sbp) if isinstance(s, Split) and s.dim == 0]
    if len(axes) != 1 or any(isinstance(s, Partial) for s in experts.sbp):
        raise ValueError(f"by_expert(experts): the expert weight must be split on dim 0 over exactly one mesh axis "
                         f"(the expert axis), and Broadcast or split on another dim (tensor parallel) elsewhere; "
                         f"it is {experts.sbp}")
    return axes[0]


def by_expert(xs: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    """xs [G, R, d] (each group's rows sorted by expert) -> ([G*R, d] expert-major, its Routing)."""
    g, r = xs.shape[0], xs.shape[1]
    n_expert = experts.shape[0]
    if tuple(counts.shape) != (g, n_expert):
        raise ValueError(f"by_expert(counts): expected [G, E] = {(g, n_expert)} (rows of each group per expert), "
                         f"got {tuple(counts.shape)}")
    if not isinstance(xs, GlobalTensor):
        c = counts.detach().to(torch.long)
        if bool((c.sum(1) != r).any()):
            raise ValueError(f"by_expert(counts): every group's counts must add up to its {r} rows")
        ids = _ids(c, torch.arange(n_expert, device=c.device))
        local = tuple(int(v) for v in c.sum(0))
        routing = Routing(torch.argsort(ids, stable=True), torch.arange(g * r), (g * r,), (g * r,), local, (),
                          token_shape=tuple(xs.shape))
    else:
        xs, counts = _token_side(xs, counts, experts)
        routing = _global_routing(xs, counts, experts)
    return _Regroup.apply(xs, routing, True), routing


def _token_side(xs: GlobalTensor, counts: Any, experts: Any) -> tuple[GlobalTensor, GlobalTensor]:
    """Rows and counts with the groups split over the expert axis (and split or whole elsewhere).

    The router leaves them so whenever the groups divide over the ranks; otherwise (a size-1 or uneven
    group dim, which the dispatcher may keep whole or Partial) they are converted here, so that the
    count exchange and the rows' all-to-all always start from one known layout.
    """
    if not isinstance(xs, GlobalTensor) or not isinstance(counts, GlobalTensor) or \
            not isinstance(experts, GlobalTensor):
        raise ValueError("by_expert: xs, counts and experts must all be GlobalTensors or all plain tensors")
    if isinstance(xs, RaggedTensor) or isinstance(counts, RaggedTensor):
        raise ValueError("by_expert(xs): takes the token side (groups split on dim 0), not a ragged tensor")
    axis = _expert_axis(experts)
    want = tuple(Split(0) if a == axis or s == Split(0) else Broadcast() for a, s in enumerate(xs.sbp))
    if xs.sbp != want:
        xs = xs.to_global(xs.placement, want)
    if counts.placement != xs.placement or counts.sbp != want:
        counts = counts.to_global(xs.placement, want)
    return xs, counts


def _global_routing(xs: GlobalTensor, counts: GlobalTensor, experts: GlobalTensor) -> Routing:
    """The count exchange (one all-gather over the expert axis) and everything the rows' moves need."""
    axis = _expert_axis(experts)
    if experts.placement != xs.placement:
        raise ValueError("by_expert(experts): the expert weight must be on the tokens' placement")
    comm = context.current()
    p = xs.placement
    n_expert, rows = experts.shape[0], xs.shape[1]
    coord = p.coord(comm.rank)
    sbp = tuple(Ragged(0) if a == axis or s == Split(0) else Broadcast() for a, s in enumerate(xs.sbp))
    expert_layout = Layout(p, sbp)
    if coord is None:
        empty = torch.zeros(0, dtype=torch.long)
        return Routing(empty, empty, (), (), (), (), xs._layout, tuple(xs.shape), expert_layout,
                       tuple(None for _ in sbp))
    peers = p.group(comm.rank, axis)
    n, me = len(peers), peers.index(comm.rank)
    mine = counts._local.to(torch.long)
    if bool((mine.sum(1) != rows).any()):
        raise ValueError(f"by_expert(counts): every group's counts must add up to its {rows} rows")
    shapes = [counts._layout.local_shape(counts.shape, q) for q in peers]
    pieces = comm.all_gather(mine, peers, shapes)                 # the count exchange
    starts = [split_range(n_expert, n, j) for j in range(n)]      # each member's experts: (first, how many)
    block = lambda c, j: c[:, starts[j][0]:starts[j][0] + starts[j][1]]  # noqa: E731
    send = tuple(int(block(mine, j).sum()) for j in range(n))
    recv = tuple(int(block(c, me).sum()) for c in pieces)
    sizes_here = tuple(sum(int(block(c, j).sum()) for c in pieces) for j in range(n))
    e0, ne = starts[me]
    local_experts = torch.arange(e0, e0 + ne)
    # each sender's rows arrive expert-major over its groups; a stable sort by expert makes (expert, sender, group)
    ids = torch.cat([local_experts.repeat_interleave(block(c, me).sum(0)) for c in pieces])
    per_expert = tuple(int(sum(block(c, me)[:, e].sum() for c in pieces)) for e in range(ne))
    sizes = tuple(sizes_here if a == axis else None for a in range(p.ndim))
    return Routing(torch.argsort(_ids(mine, torch.arange(n_expert)), stable=True), torch.argsort(ids, stable=True),
                   send, recv, per_expert, tuple(peers), xs._layout, tuple(xs.shape), expert_layout, sizes)


def by_group(y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The inverse of `by_expert`: expert-major rows [G*R, d] back to [G, R, d], each group's rows by expert."""
    return _Regroup.apply(y, routing, False)


def _forward_rows(local: torch.Tensor, routing: Routing, comm: Any) -> torch.Tensor:
    """Token side -> expert side on this rank's shard: sort by expert, the all-to-all, sort the arrivals."""
    rows = local.reshape(-1, local.shape[-1])[routing.sort_local]
    if routing.peers:
        d = rows.shape[-1]
        out = rows.new_empty((sum(routing.recv), d))
        comm.all_to_all_into(rows.contiguous().view(-1), [k * d for k in routing.send], out.view(-1),
                             [k * d for k in routing.recv], routing.peers)
        rows = out
    return rows[routing.sort_received]


def _backward_rows(local: torch.Tensor, routing: Routing, comm: Any, token_local_shape: tuple) -> torch.Tensor:
    """Expert side -> token side: the exact reverse of `_forward_rows` (inverse sorts, all-to-all back)."""
    d = local.shape[-1]
    rows = torch.empty_like(local)
    rows[routing.sort_received] = local
    if routing.peers:
        out = rows.new_empty((sum(routing.send), d))
        comm.all_to_all_into(rows.contiguous().view(-1), [k * d for k in routing.recv], out.view(-1),
                             [k * d for k in routing.send], routing.peers)
        rows = out
    back = torch.empty_like(rows)
    back[routing.sort_local] = rows
    return back.reshape(token_local_shape[:-1] + (d,))


class _Regroup(torch.autograd.Function):
    """Token side <-> expert side; the backward is the other direction on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: Routing, to_experts: bool) -> torch.Tensor:  # type: ignore[override]
        if isinstance(x, RaggedTensor) == to_experts and routing.peers:
            raise ValueError("by_expert/by_group: by_expert takes the token side (split groups), by_group the "
                             "ragged expert side")
        ctx.routing, ctx.to_experts = routing, to_experts
        ctx.shape = tuple(x.shape)
        return _move(x, routing, to_experts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        routing = ctx.routing
        if isinstance(grad, GlobalTensor):
            want = routing.expert_layout if ctx.to_experts else grad_layout(routing.token_layout)
            if grad._layout != want or (ctx.to_experts and getattr(grad, "_sizes", None) != routing.sizes):
                grad = _to(grad, want, routing.sizes if ctx.to_experts else None)
        return _move(grad, routing, not ctx.to_experts), None, None


def _to(grad: GlobalTensor, layout: Layout, sizes: Any) -> GlobalTensor:
    """A gradient that arrived in another layout (a Broadcast one from a sum's backward) put in the one needed."""
    if isinstance(grad, RaggedTensor) or sizes is not None:
        return convert(grad, layout, sizes)
    return grad.to_global(layout.placement, layout.sbp)


def _move(x: torch.Tensor, routing: Routing, to_experts: bool) -> torch.Tensor:
    comm = context.current() if routing.peers else None
    if not isinstance(x, GlobalTensor):
        if to_experts:
            return _forward_rows(x, routing, comm)
        return _backward_rows(x, routing, comm, routing.token_shape[:-1] + (x.shape[-1],))
    inside = x.placement.coord(context.current().rank) is not None
    if to_experts:
        local = _forward_rows(x._local, routing, comm) if inside else x._local.new_empty((0,))
        shape = (routing.token_shape[0] * routing.token_shape[1], x.shape[-1])
        return make(local, routing.expert_layout, shape, routing.sizes)
    shape = routing.token_shape[:-1] + (x.shape[-1],)
    local_shape = routing.token_layout.local_shape(shape, context.current().rank)
    local = _backward_rows(x._local, routing, comm, local_shape) if inside else x._local.new_empty((0,))
    return GlobalTensor(local, routing.token_layout, shape)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], routing: Routing) -> torch.Tensor:
    """x [N, a] expert-major rows (from `by_expert`) -> [N, c]: rows of expert e times w[e] [a, c], plus b[e].

    On global tensors x is ragged on the expert axis and w, b split on dim 0 there: each rank runs its
    own experts on the rows it holds, nothing moves. A mesh axis that splits w on another dim is a
    tensor axis (Megatron, per expert): split on c (column-parallel; x whole there) the output is split
    on its dim 1 and the input gradient is Partial (its consumer, `by_expert`'s backward, reduces it
    once); split on a (row-parallel; x split on dim 1 there) the products are Partial and reduced here,
    once, before the bias is added (otherwise every rank of the axis would add it).
    """
    return _GroupedLinear.apply(x, w, b, routing)


def _grouped(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], per_expert: tuple) -> torch.Tensor:
    if len(per_expert) != w.shape[0]:
        raise ValueError(f"grouped_linear(w): holds {w.shape[0]} experts here but the routing has {len(per_expert)}")
    out = x.new_empty((x.shape[0], w.shape[-1]))
    start = 0
    for e, n in enumerate(per_expert):
        rows, into = x[start:start + n], out[start:start + n]   # written in place: no copy of each product
        torch.mm(rows, w[e], out=into) if b is None else torch.addmm(b[e].reshape(1, -1), rows, w[e], out=into)
        start += n
    return out


def _add_bias(out: torch.Tensor, b: torch.Tensor, per_expert: tuple) -> torch.Tensor:
    """The row-parallel bias, added after the reduction (once, not once per rank of the tensor axis)."""
    start = 0
    for e, n in enumerate(per_expert):
        out[start:start + n] += b[e].reshape(1, -1)
        start += n
    return out


def _param_grad_layout(p: GlobalTensor | Layout, x: GlobalTensor) -> Layout:
    """Where the rows are cut (each rank holds other tokens' rows), each rank's gradient is one term: Partial."""
    return Layout(p.placement, tuple(s if isinstance(s, Split) else Partial()
                                     if isinstance(t, (Ragged, Split)) and t.dim == 0 else s
                                     for s, t in zip(p.sbp, x.sbp)))


def _tensor_layouts(x: GlobalTensor, w: GlobalTensor, b: Optional[GlobalTensor]) -> tuple[Layout, Layout, Layout]:
    """(output's layout before any reduction, after it, input gradient's) from the roles w's split gives each
    mesh axis: expert (dim 0), column-parallel (dim 2: x whole there), row-parallel (dim 1: x split on
    its dim 1), or none (Broadcast: x's cut there passes through)."""
    out, reduced, dx = [], [], []
    for a, (s, t) in enumerate(zip(w.sbp, x.sbp)):
        bias = None if b is None else b.sbp[a]
        if isinstance(s, Split) and s.dim == 2 and isinstance(t, Broadcast) and bias in (None, Split(2)):
            out.append(Split(1)), reduced.append(Split(1)), dx.append(Partial())
        elif isinstance(s, Split) and s.dim == 1 and t == Split(1) and bias in (None, Broadcast()):
            out.append(Partial()), reduced.append(Broadcast()), dx.append(t)
        elif isinstance(s, Split) and s.dim == 0 and isinstance(t, Ragged) and t.dim == 0 or \
                isinstance(s, Broadcast) and not isinstance(t, Partial) and not (isinstance(t, Split) and t.dim):
            out.append(t), reduced.append(t), dx.append(t)
        else:
            raise ValueError(f"grouped_linear: on mesh axis {a} the rows are {t!r}, the weight {s!r} and the bias "
                             f"{bias!r}; expected rows ragged where the weight is S(0) (experts), whole where it is "
                             "S(2) (column-parallel, bias S(2)), S(1) where it is S(1) (row-parallel, bias B), "
                             "or a Broadcast weight")
    p = x.placement
    return Layout(p, tuple(out)), Layout(p, tuple(reduced)), Layout(p, tuple(dx))


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, routing):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.routing, ctx.has_bias = routing, b is not None
        ctx.b_shape = None if b is None else tuple(b.shape)
        if not isinstance(x, GlobalTensor):
            return _grouped(x, w, b, routing.per_expert)
        if not isinstance(x, RaggedTensor) or x._layout.ragged_axes != routing.expert_layout.ragged_axes:
            raise ValueError(f"grouped_linear(x): expected by_expert's rows (ragged {routing.expert_layout.sbp}), got "
                             f"{getattr(x, 'sbp', None)}")
        out_layout, reduced, dx_layout = _tensor_layouts(x, w, b)
        ctx.b_layout = None if b is None else b._layout
        ctx.out_layout, ctx.dx_layout = reduced, dx_layout
        inside = x.placement.coord(context.current().rank) is not None
        late_bias = out_layout != reduced and b is not None
        local = _grouped(x._local, w._local, None if b is None or late_bias else b._local, routing.per_expert) \
            if inside else x._local.new_empty((0,))
        y = make(local, out_layout, (x.shape[0], w.shape[-1]), x._sizes)
        if out_layout != reduced:      # row-parallel: the one reduction of the Partial products
            y = convert(y, reduced, x._sizes)
            if late_bias and inside:
                _add_bias(y._local, b._local, routing.per_expert)
        return y

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, w = ctx.saved_tensors
        routing = ctx.routing
        glob = isinstance(x, GlobalTensor)
        if glob and (gy._layout != ctx.out_layout or getattr(gy, "_sizes", None) != x._sizes):
            gy = _to(gy, ctx.out_layout, x._sizes)
        xl, wl, gl = (x._local, w._local, gy._local) if glob else (x, w, gy)
        inside = not glob or x.placement.coord(context.current().rank) is not None
        dx, dw = torch.empty_like(xl), torch.empty_like(wl)
        db = None
        if ctx.has_bias and inside:
            b_local = ctx.b_shape if not glob else ctx.b_layout.local_shape(ctx.b_shape, context.current().rank)
            db = wl.new_zeros((wl.shape[0],) + tuple(b_local[1:]))
        elif ctx.has_bias:
            db = wl.new_empty((0,))
        if inside:
            start = 0
            for e, n in enumerate(routing.per_expert):
                rows, g = xl[start:start + n], gl[start:start + n]
                torch.mm(g, wl[e].T, out=dx[start:start + n])
                torch.mm(rows.T, g, out=dw[e])     # an expert without rows: zeros
                if db is not None:
                    torch.sum(g, 0, out=db[e].view(-1))
                start += n
        else:
            dx.zero_(), dw.zero_()
        if not glob:
            return dx, dw, db, None
        dbt = None if db is None else GlobalTensor(db, _param_grad_layout(ctx.b_layout, x), ctx.b_shape)
        return (make(dx, ctx.dx_layout, tuple(x.shape), x._sizes),
                GlobalTensor(dw, _param_grad_layout(w, x), tuple(w.shape)), dbt, None)
