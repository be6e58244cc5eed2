"""Attention over a sequence split: ring, Ulysses and all-gather-KV, forced or chosen by cost.

Every method's forward and gradients (through `F.scaled_dot_product_attention`
and autograd) equal one device in fp64; the ring receives exactly n - 1 key and
value blocks per rank forward; forcing Ulysses where the heads do not divide
the axis is an error that names them and suggests the ring.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import globaltensor as gt
from ops_support import Mesh, mesh_placement

D = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)
SEQ = gt.split(2)
# the collective each method runs in the forward when q, k, v arrive split on the sequence
MARK = {"ring": "send_recv", "ulysses": "all_to_all", "allgather": "all_gather"}


@contextmanager
def _pieces(count: int):
    """Ring blocks cut into `count` pieces whatever their size (the pieces the simulator's ranks, threads
    of this process, all read), so that small shapes take the blockwise path long sequences take."""
    from globaltensor.ops import ring_attention
    names = ("PIECES", "QUERY_PIECES", "FORWARD_PIECES", "MIN_PIECE_ROWS")
    saved = [getattr(ring_attention, name) for name in names]
    for name, value in zip(names, (count, count, count, 1)):
        setattr(ring_attention, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(ring_attention, name, value)


def _inputs(b: int, heads: int, kv_heads: int, seq: int, hd: int = 4, seed: int = 0) -> list:
    torch.manual_seed(seed)
    return [torch.randn(b, heads, seq, hd, dtype=D)] + [torch.randn(b, kv_heads, seq, hd, dtype=D)
                                                        for _ in range(2)]


def _attend(q, k, v, causal: bool):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def _one_device(inputs: list, causal: bool) -> tuple:
    xs = [t.clone().requires_grad_() for t in inputs]
    out = _attend(*xs, causal)
    torch.manual_seed(1)
    (out * torch.randn(out.shape, dtype=D)).sum().backward()
    return out.detach(), [x.grad for x in xs]


def _global(inputs: list, causal: bool, mesh: tuple, sbp: tuple, method: str) -> list:
    """Per rank: (output, input gradients) full, the forward's and backward's comm events, output sbp."""
    def body():
        p = mesh_placement(mesh)
        xs = [gt.to_global(t, p, sbp).requires_grad_() for t in inputs]
        with gt.attention_method(method):
            with gt.comm_log() as fwd:
                out = _attend(*xs, causal)
            torch.manual_seed(1)
            loss = (out * gt.to_global(torch.randn(out.shape, dtype=D), p, out.sbp)).sum()
            with gt.comm_log() as bwd:
                loss.backward()
        return out.full_tensor(), [x.grad.full_tensor() for x in xs], fwd.events, bwd.events, out.sbp
    return gt.launch(body, math.prod(mesh))


def _check(inputs, causal, mesh, sbp, method) -> list:
    want_out, want_grads = _one_device(inputs, causal)
    results = _global(inputs, causal, mesh, sbp, method)
    for out, grads, *_ in results:
        torch.testing.assert_close(out, want_out, **TOL)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, **TOL)
    return results


def _ulysses_fits(mesh: tuple, sbp: tuple, *heads: int) -> bool:
    """Whether each sequence axis divides the heads a rank holds (after a heads split on other axes)."""
    per_rank = [-(-h // math.prod(n for n, s in zip(mesh, sbp) if s == gt.split(1))) for h in heads]
    return all(h % n == 0 for h in per_rank for n, s in zip(mesh, sbp) if s == SEQ)


def _kinds(events) -> set:
    return {e.kind for e in events}


CASES = [  # (mesh, sbp of q/k/v, batch, heads, kv heads, seq)
    ((2,), (SEQ,), 2, 4, 4, 8),
    ((3,), (SEQ,), 1, 3, 3, 7),                            # uneven sequence split
    ((4,), (SEQ,), 1, 4, 2, 10),                           # GQA, uneven
    ((2,), (SEQ,), 1, 4, 2, 6),                            # GQA whose key/value heads Ulysses can split
    ((2, 2), (gt.split(0), SEQ), 2, 2, 2, 5),              # batch on axis 0, sequence on axis 1
    ((2, 2), (SEQ, gt.split(1)), 1, 4, 2, 7),              # sequence on axis 0, heads (TP) on axis 1
    ((2, 2), (SEQ, SEQ), 1, 4, 4, 9),                      # the sequence over both axes: a ring of 4
]


@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-b{c[2]}h{c[3]}kv{c[4]}s{c[5]}")
def test_forced_method_equals_one_device(case, causal, method):
    mesh, sbp, b, h, kvh, s = case
    if method == "ulysses" and not _ulysses_fits(mesh, sbp, h, kvh):
        pytest.skip("Ulysses needs heads divisible by the axis (test_forced_ulysses_names_the_heads)")
    results = _check(_inputs(b, h, kvh, s), causal, mesh, sbp, method)
    fwd = _kinds(results[0][2])
    if method == "ulysses":  # the sequence's axes now split the heads (the planner may move them p2p)
        assert all(o == gt.split(1) for o, i in zip(results[0][4], sbp) if i == SEQ), results[0][4]
    else:
        assert MARK[method] in fwd, (method, fwd)
        assert not ({"send_recv", "all_to_all", "all_gather"} - {MARK[method]}) & fwd, (method, fwd)
    if method in ("ring", "allgather"):
        assert results[0][4] == sbp  # the output keeps the sequence split (causal too: each rank its rows)


def _block_bytes(shape: tuple, ranks: int, index: int) -> int:
    b, h, s, hd = shape
    return b * h * (s // ranks + (index < s % ranks)) * hd * 8


@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("n, s, causal", [(2, 8, False), (3, 7, True), (4, 10, True)])
def test_ring_receives_the_other_blocks_exactly(n, s, causal, pieces):
    """Forward: n - 1 blocks of k and of v per rank; backward: those again and every block of dk, dv.
    Blockwise within the steps (`pieces` per block, one message each) the bytes are the same."""
    inputs = _inputs(1, 2, 1, s)
    with _pieces(pieces):
        results = _check(inputs, causal, (n,), (SEQ,), "ring")
    shape = tuple(inputs[1].shape)
    for rank, (_, _, fwd, bwd, _) in enumerate(results):
        others = sum(_block_bytes(shape, n, j) for j in range(n) if j != rank)
        everyone = sum(_block_bytes(shape, n, j) for j in range(n))
        assert [e.kind for e in fwd] == ["send_recv"] * 2 * (n - 1) * pieces
        assert sum(e.recv_bytes for e in fwd) == 2 * others
        ring = [e for e in bwd if e.kind == "send_recv"]
        assert sum(e.recv_bytes for e in ring) == 2 * others + 2 * everyone


def test_auto_takes_the_ring_where_heads_do_not_divide():
    """3 heads on 2 ranks: Ulysses would leave one rank a head short; the ring keeps every rank busy."""
    results = _check(_inputs(1, 3, 3, 8), True, (2,), (SEQ,), "auto")
    assert _kinds(results[0][2]) == {"send_recv"}


def test_auto_takes_ulysses_where_heads_divide():
    """4 heads on 2 ranks, one sequence: three all-to-alls move less than the ring's key/value blocks."""
    results = _check(_inputs(1, 4, 4, 8), True, (2,), (SEQ,), "auto")
    assert _kinds(results[0][2]) == {"all_to_all"}


def test_auto_prefers_the_ring_to_the_all_gather_at_equal_bytes():
    """Without causal (both offered) on 3 heads: the same bytes, but no rank holds all keys."""
    results = _check(_inputs(1, 3, 3, 6), False, (2,), (SEQ,), "auto")
    assert _kinds(results[0][2]) == {"send_recv"}


def test_forced_ulysses_names_the_heads():
    def body():
        p = mesh_placement((2,))
        q, k, v = (gt.to_global(t, p, SEQ) for t in _inputs(1, 3, 3, 6))
        with gt.attention_method("ulysses"):
            try:
                _attend(q, k, v, True)
            except ValueError as e:
                return str(e)
    msg = gt.launch(body, 2)[0]
    assert msg is not None and "3 heads" in msg and "not divisible by 2" in msg
    assert "attention_method('ring')" in msg


def test_method_is_part_of_the_decision():
    """One program, one call site, two methods: the decision cache keys on the method."""
    def body():
        p = mesh_placement((2,))
        q, k, v = (gt.to_global(t, p, SEQ) for t in _inputs(1, 4, 4, 8))
        kinds = []
        for method in ("ring", "ulysses", "ring", "auto"):
            with gt.attention_method(method), gt.comm_log() as log:
                _attend(q, k, v, False)
            kinds.append(_kinds(log.events))
        return kinds
    assert gt.launch(body, 2)[0] == [{"send_recv"}, {"all_to_all"}, {"send_recv"}, {"all_to_all"}]


def test_attention_method_checks_its_argument_and_restores():
    with pytest.raises(ValueError, match="'zigzag' is not one of"):
        gt.attention_method("zigzag")
    from globaltensor.ops.attention import current_attention_method
    with gt.attention_method("ring"):
        assert current_attention_method() == "ring"
    assert current_attention_method() == "auto"


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_equals_one_device_with_the_keys_gathered(causal):
    """Torch's CPU attention with dropout never reaches the flash kernels this module rules (they refuse
    dropout): it decomposes into bmm, softmax, a bernoulli_ mask over [B, H, L, S] and bmm. On a sequence
    split the queries stay split, the keys and values are gathered (n - 1 blocks of each, no ring) and
    the mask is drawn at global size on every rank (`ops/random.py`), so, the ring forced or not, the
    output, the gradients and the generator after the call equal one device's (`ops/attention.py` says
    why no ring runs it)."""
    n, inputs = 2, _inputs(1, 2, 2, 6)
    xs = [t.clone().requires_grad_() for t in inputs]
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(*xs, dropout_p=0.5, is_causal=causal)
    want.backward(torch.ones_like(want))
    want_next = torch.rand(4)

    def body():
        p = mesh_placement((n,))
        q, k, v = (gt.to_global(t, p, SEQ).requires_grad_() for t in inputs)
        torch.manual_seed(3)
        with gt.attention_method("ring"), gt.comm_log() as log:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=causal)
        nxt = torch.rand(4)
        out.backward(gt.to_global(torch.ones(out.shape, dtype=D), p, out.sbp))
        return (out.full_tensor(), [t.grad.full_tensor() for t in (q, k, v)], nxt,
                [(e.kind, e.recv_bytes) for e in log.events])
    for rank, (out, grads, nxt, events) in enumerate(gt.launch(body, n)):
        torch.testing.assert_close(out, want.detach(), **TOL)
        for g, x in zip(grads, xs):
            torch.testing.assert_close(g, x.grad, **TOL)
        assert torch.equal(nxt, want_next)
        block = _block_bytes(tuple(inputs[1].shape), n, 1 - rank)
        assert events == [("all_gather", block)] * 2, events


@given(st.sampled_from([(2,), (3,), (4,), (2, 2), (1, 3), (2, 1)]), st.integers(1, 9),
       st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 3), (4, 2), (4, 4)]), st.integers(1, 2), st.booleans(),
       st.sampled_from(["ring", "auto", "ulysses", "allgather"]), st.integers(1, 4), st.data())
def test_sequence_split_equals_one_device(mesh, s, heads, b, causal, method, pieces, data):
    """`pieces`: the ring's blocks cut into that many (some empty where a block has fewer rows)."""
    h, kvh = heads
    other = data.draw(st.sampled_from([gt.broadcast, gt.split(0), gt.split(1), SEQ]))
    sbp = (SEQ,) if len(mesh) == 1 else ((SEQ, other) if data.draw(st.booleans()) else (other, SEQ))
    if method == "ulysses" and not _ulysses_fits(mesh, sbp, h, kvh):
        method = "auto"  # forced, it raises where the heads do not divide (its own test)
    with _pieces(pieces):
        _check(_inputs(b, h, kvh, s, seed=s), causal, Mesh(mesh), sbp, method)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-b{c[2]}h{c[3]}kv{c[4]}s{c[5]}")
def test_blockwise_ring_equals_one_device(case):
    """Causal, each block cut into 3 pieces (a block of 2 rows: one piece empty): a piece's diagonal
    with the whole query block is cut at the piece's rows, query pieces meet key pieces in the
    backward, and the gradient accumulators come home piece by piece."""
    mesh, sbp, b, h, kvh, s = case
    with _pieces(3):
        _check(_inputs(b, h, kvh, s), True, mesh, sbp, "ring")


def _gloo_ring():
    p = gt.placement("cpu", [0, 1])
    inputs = _inputs(1, 2, 2, 5)
    xs = [gt.to_global(t, p, SEQ).requires_grad_() for t in inputs]
    with gt.attention_method("ring"):
        with gt.comm_log() as log:
            out = _attend(*xs, True)
        out.sum().backward()
    return out.full_tensor(), [x.grad.full_tensor() for x in xs], _kinds(log.events)


def test_ring_under_gloo():
    inputs = _inputs(1, 2, 2, 5)
    xs = [t.clone().requires_grad_() for t in inputs]
    want = _attend(*xs, True)
    want.sum().backward()
    for out, grads, kinds in gt.launch(_gloo_ring, 2, backend="gloo"):
        assert kinds == {"send_recv"}
        torch.testing.assert_close(out, want.detach(), **TOL)
        for g, x in zip(grads, xs):
            torch.testing.assert_close(g, x.grad, **TOL)


@pytest.mark.parametrize("mesh, sbp", [((4,), (gt.split(1),)), ((2, 2), (gt.split(1), SEQ)),
                                       ((2, 2), (gt.split(1), gt.split(1)))])
def test_gqa_heads_split_pairs_query_heads_with_their_keys(mesh, sbp):
    """4 query heads over 2 key heads: a heads split is only taken where each rank's query heads read
    exactly its own key heads (on 4 ranks the keys' 2 heads cannot be split alike)."""
    _check(_inputs(1, 4, 2, 6), True, mesh, sbp, "auto")


def _ring_program():
    p = gt.placement("cpu", [0, 1, 2])
    q, k, v = (gt.to_global(torch.randn(1, 2, 7, 4, dtype=D), p, SEQ).requires_grad_() for _ in range(3))
    with gt.attention_method("ring"):
        _attend(q, k, v, True).sum().backward()


def test_dry_run_counts_the_ring():
    """gt.explain runs the ring on meta shards: the same messages and bytes as a real run."""
    def real():
        with gt.comm_log() as log:
            _ring_program()
        return log.recv_bytes
    dry = [rep.recv_bytes for rep in gt.explain(_ring_program, 3)]
    assert dry == gt.launch(real, 3) and min(dry) > 0


@pytest.mark.parametrize("method", ["ring", "auto"])
def test_backward_keeps_the_sequence_split(method):
    """out.sum().backward(): the gradient arrives Broadcast; gathering q, k, v, out would move fewer
    bytes than the ring's backward at n = 2, but every rank would hold and compute the whole sequence.
    A sequence split is gathered only where no method can run."""
    def body():
        p = mesh_placement((2,))
        q, k, v = (gt.to_global(t, p, SEQ).requires_grad_() for t in _inputs(1, 3, 3, 8))
        with gt.attention_method(method):
            out = _attend(q, k, v, True)
            with gt.comm_log() as log:
                out.sum().backward()
        return _kinds(log.events), q.grad.sbp
    kinds, sbp = gt.launch(body, 2)[0]
    assert kinds == {"send_recv"} and sbp == (SEQ,)


# -- zigzag: the load-balanced causal split (gt.zigzag(2)) -----------------------------------------
ZIG = gt.zigzag(2)
ZIGZAG_CASES = [  # (mesh, sbp of q/k/v, batch, heads, kv heads, seq)
    ((2,), (ZIG,), 2, 4, 4, 8),
    ((3,), (ZIG,), 1, 3, 3, 7),                            # uneven chunks
    ((4,), (ZIG,), 1, 4, 2, 10),                           # GQA, uneven
    ((2, 2), (gt.split(0), ZIG), 2, 2, 2, 5),              # batch on axis 0, zigzag sequence on axis 1
    ((2, 2), (ZIG, gt.split(1)), 1, 4, 2, 7),              # zigzag sequence on axis 0, heads on axis 1
]


@pytest.mark.parametrize("causal, pieces", [(False, 1), (True, 1), (True, 3)])
@pytest.mark.parametrize("case", ZIGZAG_CASES, ids=lambda c: f"{c[0]}-{c[1]}-b{c[2]}h{c[3]}kv{c[4]}s{c[5]}")
def test_zigzag_ring_equals_one_device(case, causal, pieces):
    """q, k, v zigzag: the ring runs on them as they are (no conversion), the output and the gradients
    stay zigzag and equal one device; blockwise too (3 pieces: a piece may span both chunks)."""
    mesh, sbp, b, h, kvh, s = case
    with _pieces(pieces):
        results = _check(_inputs(b, h, kvh, s), causal, mesh, sbp, "ring")
    assert _kinds(results[0][2]) == {"send_recv"} and _kinds(results[0][3]) == {"send_recv"}
    assert results[0][4] == sbp


def _count_work(monkeypatch) -> dict:
    """Per rank, the (query, key) pairs the ring's kernel calls attend (a causal call on a block with
    itself: the triangle), forward and backward, as a list cut wherever a message is posted or waited
    for: every rank posts and waits alike, so the i-th entries of two ranks are the same ring step."""
    from globaltensor.ops import ring_attention
    work: dict = {}
    real_attend, real_backward, real_pass_on = (ring_attention._attend, ring_attention._attend_backward,
                                                ring_attention._pass_on)

    def count(q, k, causal):
        nq, nk = q.shape[2], k.shape[2]
        work.setdefault(gt.rank(), [0])[-1] += nq * (nq + 1) // 2 if causal else nq * nk

    def attend(func, q, k, v, causal, scale):
        count(q, k, causal)
        return real_attend(func, q, k, v, causal, scale)

    def attend_backward(func, grad_out, q, k, v, out, lse, causal, scale):
        count(q, k, causal)
        return real_backward(func, grad_out, q, k, v, out, lse, causal, scale)

    def pass_on(*args):
        work.setdefault(gt.rank(), [0]).append(0)
        finish = real_pass_on(*args)

        def waited():
            work[gt.rank()].append(0)
            return finish()
        return waited
    monkeypatch.setattr(ring_attention, "_attend", attend)
    monkeypatch.setattr(ring_attention, "_attend_backward", attend_backward)
    monkeypatch.setattr(ring_attention, "_pass_on", pass_on)
    return work


@pytest.mark.parametrize("n, pieces", [(2, 1), (4, 1), (2, 3), (3, 2)])
def test_zigzag_balances_causal_work_and_moves_the_ring_bytes(n, pieces, monkeypatch):
    """Causal, 4n rows a piece: with zigzag every rank attends the same number of (query, key) pairs in
    every ring step, forward and backward (a rank that works more in a step makes its neighbours wait:
    the ring's pace is its slowest rank's, step by step), also blockwise; on a contiguous split the last
    rank attends (2n-1)/n of the mean (minus the diagonal's half). Bytes are the ring's: n - 1 key and
    value blocks forward, those again and every gradient block backward."""
    s = 4 * n * pieces
    inputs = _inputs(1, 2, 1, s)
    shape = tuple(inputs[1].shape)
    work = _count_work(monkeypatch)
    for name in ("PIECES", "QUERY_PIECES", "FORWARD_PIECES"):
        monkeypatch.setattr(f"globaltensor.ops.ring_attention.{name}", pieces)
    monkeypatch.setattr("globaltensor.ops.ring_attention.MIN_PIECE_ROWS", 1)
    results = _check(inputs, True, (n,), (ZIG,), "ring")
    steps = [work[r] for r in range(n)]
    zigzag = [sum(w) for w in steps]
    work.clear()
    _check(inputs, True, (n,), (SEQ,), "ring")
    contiguous = [sum(work[r]) for r in range(n)]
    b = s // n  # n diagonal triangles and n(n-1)/2 whole blocks of b x b, on either split, forward and backward
    assert sum(zigzag) == sum(contiguous) == 2 * (n * b * (b + 1) // 2 + n * (n - 1) // 2 * b * b)
    assert len(set(zigzag)) == 1, zigzag
    assert all(w == steps[0] for w in steps), steps
    assert max(contiguous) / (sum(contiguous) / n) > 1.3, contiguous
    for rank, (_, _, fwd, bwd, _) in enumerate(results):
        others = sum(_block_bytes(shape, n, j) for j in range(n) if j != rank)
        everyone = sum(_block_bytes(shape, n, j) for j in range(n))
        assert [e.kind for e in fwd] == ["send_recv"] * 2 * (n - 1) * pieces
        assert sum(e.recv_bytes for e in fwd) == 2 * others
        assert sum(e.recv_bytes for e in bwd) == 2 * others + 2 * everyone


@pytest.mark.parametrize("method, kinds", [("auto", {"send_recv"}), ("ulysses", {"all_to_all"})])
def test_zigzag_causal_takes_the_ring_unless_another_method_is_forced(method, kinds):
    """"auto" keeps a zigzag split on the ring (the layout exists for it); forced Ulysses first recuts
    q, k, v to the contiguous split (an all-to-all each), then runs as on a contiguous split."""
    results = _check(_inputs(1, 4, 4, 8), True, (2,), (ZIG,), method)
    assert _kinds(results[0][2]) == kinds


def test_zigzag_backward_from_a_broadcast_gradient_stays_on_the_ring():
    """out.sum().backward(): the gradient arrives Broadcast and is sliced into zigzag order locally;
    the backward is the ring's messages only, and q's gradient is zigzag."""
    inputs = _inputs(1, 3, 3, 8)
    xs = [t.clone().requires_grad_() for t in inputs]
    _attend(*xs, True).sum().backward()

    def body():
        p = mesh_placement((2,))
        q, k, v = (gt.to_global(t, p, ZIG).requires_grad_() for t in inputs)
        out = _attend(q, k, v, True)
        with gt.comm_log() as log:
            out.sum().backward()
        return _kinds(log.events), q.grad.sbp, [t.grad.full_tensor() for t in (q, k, v)]
    for kinds, sbp, grads in gt.launch(body, 2):
        assert kinds == {"send_recv"} and sbp == (ZIG,)
        for g, x in zip(grads, xs):
            torch.testing.assert_close(g, x.grad, **TOL)


@pytest.mark.parametrize("seq", [SEQ, ZIG])
def test_ring_with_an_empty_heads_shard(seq):
    """One head split over two ranks: one rank's q, k, v are empty and its ring steps attend nothing (the
    CPU kernels divide by the shard's size), while it still passes the blocks on."""
    _check(_inputs(1, 1, 1, 5), True, (2, 2), (seq, gt.split(1)), "ring")



def _chunks(draw, length: int) -> tuple:
    """Increasing disjoint global row ranges within [0, length) (a contiguous, zigzag or piece's rows)."""
    cuts = sorted(draw(st.sets(st.integers(0, length), min_size=2, max_size=6)))
    pairs = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
    return tuple(p for p in pairs if draw(st.booleans())) or pairs[:1]


@given(st.data())
def test_blocks_attend_each_causal_pair_once(data):
    """The calls `_blocks` plans for any query and key rows attend every (query, key) pair with the
    key not after the query exactly once; a masked call has the same rows on both sides."""
    from globaltensor.ops.ring_attention import _blocks
    q_rows, k_rows = _chunks(data.draw, 12), _chunks(data.draw, 12)
    q_global = [a + i for a, n in q_rows for i in range(n)]  # local row -> global row
    k_global = [a + i for a, n in k_rows for i in range(n)]
    seen: list = []
    for (qs, qn), (ks, kn), masked in _blocks(q_rows, k_rows, True):
        if masked:
            assert qn == kn and q_global[qs:qs + qn] == k_global[ks:ks + kn]
        seen += [(q_global[qs + i], k_global[ks + j]) for i in range(qn) for j in range(kn)
                 if not masked or j <= i]
    want = [(r, c) for r in q_global for c in k_global if c <= r]
    assert sorted(seen) == sorted(want)
