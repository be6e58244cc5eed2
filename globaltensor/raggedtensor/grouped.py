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

from ..layout import Layout
from .ops import RaggedTensor, convert, local_shape, make, runs_sizes
from ..runtime import context
from ..sbp import Broadcast, Partial, Ragged, Split, split_range
from ..tensor import GlobalTensor, grad_layout


@dataclass(frozen=True)
class Routing:
    """One step's routing, as this rank needs it: data (counts), not structure, like a ragged size."""
    sort_local: torch.Tensor         # this rank's rows, group-major -> expert-major (a permutation)
    # received rows, (sender, expert, group) -> (expert, sender, group); None: already in that order
    sort_received: Optional[torch.Tensor]
    send: tuple                      # rows sent to each of the peers
    recv: tuple                      # rows received from each of them
    per_expert: tuple                # rows of each local expert, in order (the grouped layer's offsets)
    peers: tuple                     # the ranks of this rank's expert axis group; () on one device
    # the token side's shape (and, global tensors only, its layout), the expert side's layout and sizes
    token_layout: Optional[Layout] = None
    token_shape: tuple = ()
    expert_layout: Optional[Layout] = None
    sizes: Optional[tuple] = None
    # a ragged token side's sizes (and unit: a reshape's runs), which by_group's result takes back
    token_sizes: Optional[tuple] = None
    token_unit: Optional[int] = None


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


# torch.compile: the rows each rank receives are data (the counts), so the dispatch is not traced: dynamo stops at
# `by_expert` with this reason (the error under fullgraph=True), where nothing else would name the cause
_UNTRACEABLE = ("by_expert: a dropless MoE's rows per expert are data (its counts), so the dispatch's shapes are not "
                "known at trace time; run the experts module eagerly (torch.compiler.disable on its forward) or "
                "route with a capacity (static shapes)")


@torch.compiler.disable(reason=_UNTRACEABLE)
def by_expert(xs: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor,
              index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Routing]:
    """xs [G, R, d] (each group's rows sorted by expert) -> ([G*R, d] expert-major, its Routing).

    With `index` [G, R] the rows are `xs.gather(1, index)` (xs then the tokens [G, S, d], index the
    token of each sorted row, e.g. `order // k`), read in the same one row index as the sort: a
    gather first would copy every row once more forward and scatter it once more backward."""
    g = xs.shape[0]
    r = xs.shape[1] if index is None else index.shape[-1]
    n_expert = experts.shape[0]
    if tuple(counts.shape) != (g, n_expert):
        raise ValueError(f"by_expert(counts): expected [G, E] = {(g, n_expert)} (rows of each group per expert), "
                         f"got {tuple(counts.shape)}")
    if index is not None and (index.dim() != 2 or index.shape[0] != g or index.dtype.is_floating_point
                              or index.dtype == torch.bool):
        raise ValueError(f"by_expert(index): expected integer [G, R] (the token of each sorted row, G = {g}), "
                         f"got {index.dtype} {tuple(index.shape)}")
    if not isinstance(xs, GlobalTensor):
        c = counts.detach().to(torch.long)
        if bool((c.sum(1) != r).any()):
            raise ValueError(f"by_expert(counts): every group's counts must add up to its {r} rows")
        ids = _ids(c, torch.arange(n_expert, device=c.device))
        local = tuple(int(v) for v in c.sum(0))
        routing = Routing(torch.argsort(ids, stable=True), None, (g * r,), (g * r,), local, (),
                          token_shape=(g, r) + tuple(xs.shape[2:]))
        rows = _Rows.reading_tokens(routing.sort_local, None if index is None else index.detach(), xs.shape[1])
    else:
        xs, counts, index = _token_side(xs, counts, experts, index)
        routing = _global_routing(xs, counts, experts, r)
        rows = _Rows.reading_tokens(routing.sort_local, None if index is None else index._local.detach(), xs.shape[1])
    return _Regroup.apply(xs, routing, True, rows, tuple(xs.shape)), routing


def _token_side(xs: GlobalTensor, counts: Any, experts: Any,
                index: Any = None) -> tuple[GlobalTensor, GlobalTensor, Optional[GlobalTensor]]:
    """Rows, counts (and index) with the groups split over the expert axis (and split or whole elsewhere).

    The router leaves them so whenever the groups divide over the ranks; otherwise (a size-1 or uneven
    group dim, which the dispatcher may keep whole or Partial) they are converted here, so that the
    count exchange and the rows' all-to-all always start from one known layout.
    """
    if not isinstance(xs, GlobalTensor) or not isinstance(counts, GlobalTensor) or \
            not isinstance(experts, GlobalTensor) or not isinstance(index, (GlobalTensor, type(None))):
        raise ValueError("by_expert: xs, counts, experts (and index) must all be GlobalTensors or all plain tensors")
    axis = _expert_axis(experts)
    if isinstance(xs, RaggedTensor) and _ragged_groups(xs, axis):   # uneven groups cut as they are: kept
        counts = _index_on(counts, xs._layout, xs._sizes)
        return xs, counts, _index_on(index, xs._layout, xs._sizes)
    if isinstance(xs, RaggedTensor):
        xs = xs.to_global(xs.placement, tuple(Split(s.dim) if isinstance(s, Ragged) else s for s in xs.sbp))
    want = tuple(Split(0) if a == axis or s == Split(0) else Broadcast() for a, s in enumerate(xs.sbp))
    if xs.sbp != want:
        xs = xs.to_global(xs.placement, want)
    if counts.placement != xs.placement or counts.sbp != want or isinstance(counts, RaggedTensor):
        counts = _index_on(counts, xs._layout)
    return xs, counts, _index_on(index, xs._layout)


def _ragged_groups(xs: RaggedTensor, axis: int) -> bool:
    """Whether a ragged token side is taken as it is: its groups (dim 0) cut on the expert axis, the
    innermost of the axes that cut them (the expert axis' peers then share one piece of the outer cuts,
    whose sizes this rank knows) or anywhere where they are a reshape's runs (every rank's sizes follow
    from the unit), every other axis Broadcast."""
    cut = [a for a, s in enumerate(xs.sbp) if isinstance(s, (Split, Ragged))]
    runs = xs._unit is not None and runs_sizes(xs._layout, xs.shape, xs._unit) == xs._sizes
    return axis in cut and (axis == max(cut) or runs) and all(xs.sbp[a] == Ragged(0) for a in cut) and \
        all(isinstance(s, Broadcast) for a, s in enumerate(xs.sbp) if a not in cut)


def _index_on(index: Optional[GlobalTensor], layout: Layout, sizes: Optional[tuple] = None) -> Optional[GlobalTensor]:
    """`index` (or counts) laid out as the token side (`sizes`: its ragged sizes)."""
    if index is None:
        return None
    if index.placement != layout.placement or index._layout != layout or getattr(index, "_sizes", None) != sizes:
        if sizes is not None or isinstance(index, RaggedTensor):
            return convert(index, layout, sizes, getattr(index, "_unit", None))
        index = index.to_global(layout.placement, layout.sbp)
    return index


def _global_routing(xs: GlobalTensor, counts: GlobalTensor, experts: GlobalTensor, rows: int) -> Routing:
    """The count exchange (one all-gather over the expert axis) and everything the rows' moves need.

    The counts arrive as one [n, G_r, E] block and everything else is read off it in Python ints: a
    loop of small tensor sums per peer and expert would cost more than the exchange itself."""
    axis = _expert_axis(experts)
    if experts.placement != xs.placement:
        raise ValueError("by_expert(experts): the expert weight must be on the tokens' placement")
    comm = context.current()
    p = xs.placement
    n_expert = experts.shape[0]
    token_shape = (xs.shape[0], rows) + tuple(xs.shape[2:])
    coord = p.coord(comm.rank)
    sbp = tuple(Ragged(0) if a == axis or isinstance(s, (Split, Ragged)) and s.dim == 0 else Broadcast()
                for a, s in enumerate(xs.sbp))
    expert_layout = Layout(p, sbp)
    token_sizes, token_unit = getattr(xs, "_sizes", None), getattr(xs, "_unit", None)
    if coord is None:
        empty = torch.zeros(0, dtype=torch.long)
        return Routing(empty, None, (), (), (), (), xs._layout, token_shape, expert_layout,
                       tuple(None for _ in sbp), token_sizes, token_unit)
    peers = p.group(comm.rank, axis)
    n, me = len(peers), peers.index(comm.rank)
    mine = counts._local.to(torch.long)
    if bool((mine.sum(1) != rows).any()):
        raise ValueError(f"by_expert(counts): every group's counts must add up to its {rows} rows")
    shapes = [counts._layout.local_shape(counts.shape, q) if token_sizes is None else
              local_shape(counts._layout, counts.shape, token_sizes if token_unit is None else
                          runs_sizes(xs._layout, xs.shape, token_unit, q), q) for q in peers]
    pieces = comm.all_gather(mine, peers, shapes)                 # the count exchange
    per_peer = torch.stack([c.sum(0) for c in pieces]).tolist()  # [n][E]: each member's rows per expert
    starts = [split_range(n_expert, n, j) for j in range(n)]      # each member's experts: (first, how many)
    cols = [range(f, f + m) for f, m in starts]
    send = tuple(sum(per_peer[me][e] for e in cols[j]) for j in range(n))
    recv = tuple(sum(c[e] for e in cols[me]) for c in per_peer)
    sizes_here = tuple(sum(c[e] for c in per_peer for e in cols[j]) for j in range(n))
    e0, ne = starts[me]
    per_expert = tuple(sum(c[e] for c in per_peer) for e in cols[me])
    # each sender's rows arrive expert-major over its groups; a stable sort by expert makes (expert, sender, group)
    arrived = torch.tensor([c[e] for c in per_peer for e in cols[me]], dtype=torch.long)
    ids = torch.arange(ne).repeat(n).repeat_interleave(arrived)
    sizes = tuple(sizes_here if a == axis else None for a in range(p.ndim))
    return Routing(torch.argsort(_ids(mine, torch.arange(n_expert)), stable=True), torch.argsort(ids, stable=True),
                   send, recv, per_expert, tuple(peers), xs._layout, token_shape, expert_layout, sizes,
                   token_sizes, token_unit)


def by_group(y: torch.Tensor, routing: Routing, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse of `by_expert`: expert-major rows [G*R, d] back to [G, R, d], each group's rows by expert.

    With `index` [G, R'] the result is `by_group(y, routing).gather(1, index)` (e.g. the inverse of the
    sort, `order.argsort(1)`, to put the rows back in choice order), read in one row index."""
    g, r = routing.token_shape[0], routing.token_shape[1]
    if index is not None and (index.dim() != 2 or index.shape[0] != g or index.dtype.is_floating_point
                              or index.dtype == torch.bool):
        raise ValueError(f"by_group(index): expected integer [G, R'] (the sorted row of each result row, G = {g}), "
                         f"got {index.dtype} {tuple(index.shape)}")
    if index is None:
        rows = _Rows.reading_tokens(routing.sort_local, None, r)
    elif isinstance(index, GlobalTensor):
        if not isinstance(y, GlobalTensor) or routing.token_layout is None:
            raise ValueError("by_group(index): a GlobalTensor index needs the global rows of a global by_expert")
        rows = _Rows.writing_tokens(routing.sort_local, _index_on(index, routing.token_layout,
                                                                  routing.token_sizes)._local.detach(), r)
    else:
        if isinstance(y, GlobalTensor):
            raise ValueError("by_group(index): give a GlobalTensor index (groups split as the tokens) with global rows")
        rows = _Rows.writing_tokens(routing.sort_local, index.detach(), r)
    shape = (g, r if index is None else index.shape[1], y.shape[-1])
    return _Regroup.apply(y, routing, False, rows, shape)


@dataclass(frozen=True)
class _Rows:
    """This rank's token-side rows [T, d] <-> its expert-major rows [N, d] before the all-to-all, as one
    row index: `read_tokens` (expert row i is token row index[i]: by_expert), or not (token row i is
    expert row index[i]: by_group with an index). A permutation is undone by writing through the
    index; otherwise the reverse sums the rows that read the same one (a gather's backward)."""
    index: torch.Tensor
    read_tokens: bool
    permutation: bool
    n_tokens: int
    n_expert: int

    @staticmethod
    def reading_tokens(sort_local: torch.Tensor, index: Optional[torch.Tensor], per_group: int) -> "_Rows":
        """Expert row i reads token row flat[sort_local[i]], flat the index's rows offset by group."""
        n = sort_local.numel()
        if index is None:
            return _Rows(sort_local, True, True, n, n)
        index = index.to(torch.long)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= per_group):
            raise ValueError(f"by_expert(index): entries must lie in [0, {per_group}) (the tokens of a group)")
        g = index.shape[0]
        flat = (index + torch.arange(g).unsqueeze(1) * per_group).reshape(-1)
        return _Rows.of(flat[sort_local], True, g * per_group, n)

    @staticmethod
    def writing_tokens(sort_local: torch.Tensor, index: torch.Tensor, per_group: int) -> "_Rows":
        """Token row i reads the expert row holding sorted row flat[i] (the inverse of sort_local)."""
        index = index.to(torch.long)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= per_group):
            raise ValueError(f"by_group(index): entries must lie in [0, {per_group}) (the rows of a group)")
        n = sort_local.numel()
        inverse = torch.empty_like(sort_local)
        inverse[sort_local] = torch.arange(n)
        g = index.shape[0]
        flat = (index + torch.arange(g).unsqueeze(1) * per_group).reshape(-1)
        return _Rows.of(inverse[flat], False, flat.numel(), n)

    @staticmethod
    def of(index: torch.Tensor, read_tokens: bool, n_tokens: int, n_expert: int) -> "_Rows":
        into = n_tokens if read_tokens else n_expert
        perm = index.numel() == into and bool((torch.bincount(index, minlength=into) == 1).all())
        return _Rows(index, read_tokens, perm, n_tokens, n_expert)

    def to_experts(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._move(tokens, self.read_tokens, self.n_expert)

    def to_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return self._move(rows, not self.read_tokens, self.n_tokens)

    def _move(self, x: torch.Tensor, read: bool, n: int) -> torch.Tensor:
        if read:
            return x[self.index]
        if self.permutation:
            out = x.new_empty((n,) + tuple(x.shape[1:]))
            out[self.index] = x
            return out
        return x.new_zeros((n,) + tuple(x.shape[1:])).index_add_(0, self.index, x)


def _forward_rows(local: torch.Tensor, routing: Routing, rows_map: _Rows, comm: Any) -> torch.Tensor:
    """Token side -> expert side on this rank's shard: sort by expert, the all-to-all, sort the arrivals."""
    rows = rows_map.to_experts(local.reshape(-1, local.shape[-1]))
    if routing.peers:
        d = rows.shape[-1]
        out = rows.new_empty((sum(routing.recv), d))
        comm.all_to_all_into(rows.contiguous().view(-1), [k * d for k in routing.send], out.view(-1),
                             [k * d for k in routing.recv], routing.peers)
        rows = out
    return rows if routing.sort_received is None else rows[routing.sort_received]


def _backward_rows(local: torch.Tensor, routing: Routing, rows_map: _Rows, comm: Any,
                   token_local_shape: tuple) -> torch.Tensor:
    """Expert side -> token side: the exact reverse of `_forward_rows` (inverse sorts, all-to-all back)."""
    d = local.shape[-1]
    if routing.sort_received is None:
        rows = local
    else:
        rows = torch.empty_like(local)
        rows[routing.sort_received] = local
    if routing.peers:
        out = rows.new_empty((sum(routing.send), d))
        comm.all_to_all_into(rows.contiguous().view(-1), [k * d for k in routing.recv], out.view(-1),
                             [k * d for k in routing.send], routing.peers)
        rows = out
    return rows_map.to_tokens(rows).reshape(token_local_shape[:-1] + (d,))


class _Regroup(torch.autograd.Function):
    """Token side <-> expert side; the backward is the other direction on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: Routing, to_experts: bool, rows: _Rows,  # type: ignore[override]
                token_shape: tuple) -> torch.Tensor:
        expert_side = isinstance(x, RaggedTensor) and x.dim() < len(routing.token_shape)  # [G*R, d], not [G, R, d]
        if routing.peers and expert_side == to_experts:
            raise ValueError("by_expert/by_group: by_expert takes the token side (split groups), by_group the "
                             "ragged expert side")
        ctx.routing, ctx.to_experts, ctx.rows = routing, to_experts, rows
        ctx.token_shape = token_shape     # the token side's (global) shape: by_expert's input, by_group's output
        return _move(x, routing, to_experts, rows, token_shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        routing = ctx.routing
        if isinstance(grad, GlobalTensor):
            want = routing.expert_layout if ctx.to_experts else grad_layout(routing.token_layout)
            sizes = routing.sizes if ctx.to_experts else routing.token_sizes
            if grad._layout != want or getattr(grad, "_sizes", None) != sizes:
                grad = _to(grad, want, sizes, None if ctx.to_experts else routing.token_unit)
        return _move(grad, routing, not ctx.to_experts, ctx.rows, ctx.token_shape), None, None, None, None


def _to(grad: GlobalTensor, layout: Layout, sizes: Any, unit: Optional[int] = None) -> GlobalTensor:
    """A gradient that arrived in another layout (a Broadcast one from a sum's backward) put in the one needed."""
    if isinstance(grad, RaggedTensor) or sizes is not None:
        return convert(grad, layout, sizes, unit)
    return grad.to_global(layout.placement, layout.sbp)


def _move(x: torch.Tensor, routing: Routing, to_experts: bool, rows: _Rows, token_shape: tuple) -> torch.Tensor:
    comm = context.current() if routing.peers else None
    if not isinstance(x, GlobalTensor):
        if to_experts:
            return _forward_rows(x, routing, rows, comm)
        return _backward_rows(x, routing, rows, comm, token_shape)
    inside = x.placement.coord(context.current().rank) is not None
    if to_experts:
        local = _forward_rows(x._local, routing, rows, comm) if inside else x._local.new_empty((0,))
        shape = (routing.token_shape[0] * routing.token_shape[1], x.shape[-1])
        return make(local, routing.expert_layout, shape, routing.sizes)
    shape = token_shape[:-1] + (x.shape[-1],)
    rank = context.current().rank
    held = routing.token_layout.local_shape(shape, rank) if routing.token_sizes is None else \
        local_shape(routing.token_layout, shape, routing.token_sizes, rank)
    local = _backward_rows(x._local, routing, rows, comm, held) if inside else x._local.new_empty((0,))
    return make(local, routing.token_layout, shape, routing.token_sizes, unit=routing.token_unit)


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
