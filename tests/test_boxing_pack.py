"""The all-to-all packing (`boxing/pack.py`): any tiling packs to its pieces in order and unpacks back."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from globaltensor.boxing.pack import Tiling
from globaltensor.layout import slice_box


def _scratch():
    held = {}

    def buffer(numel, dtype):  # like Communicator.send_buffer: one reused buffer, sliced
        if dtype not in held or held[dtype].numel() < numel:
            held[dtype] = torch.full((numel,), float("nan")).to(dtype)
        return held[dtype][:numel]
    return buffer


@st.composite
def tilings(draw):
    """A shape, and boxes cutting one of its dims into consecutive ranges (some empty), maybe shuffled."""
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    n = draw(st.integers(1, 4))
    if draw(st.booleans()) and shape[dim] % n == 0:
        cuts = [shape[dim] // n] * n
    else:
        marks = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=n - 1, max_size=n - 1)))
        cuts = [b - a for a, b in zip([0] + marks, marks + [shape[dim]])]
    boxes, start = [], 0
    for c in cuts:
        boxes.append(tuple((start, c) if d == dim else (0, s) for d, s in enumerate(shape)))
        start += c
    if draw(st.booleans()):
        boxes = draw(st.permutations(boxes))
    return shape, boxes


@given(tilings(), st.booleans())
def test_pack_gives_the_pieces_in_order_and_unpack_restores_the_shard(case, transposed):
    shape, boxes = case
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    if transposed and len(shape) > 1:  # a non-contiguous shard of the same shape
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    tiling = Tiling.of(shape, boxes)
    packed = tiling.packer()(t, _scratch())
    want = torch.cat([slice_box(t, b).reshape(-1) for b in boxes]) if boxes else torch.empty(0)
    assert packed.is_contiguous() and packed.dim() == 1
    assert torch.equal(packed, want)
    assert list(tiling.splits) == [slice_box(t, b).numel() for b in boxes]
    unpack = tiling.unpacker()
    back = packed.clone().view(shape) if unpack is None else unpack(packed.clone())
    assert torch.equal(back, t)


def test_the_cheapest_packing_is_chosen():
    rows = [((0, 2), (0, 6)), ((2, 2), (0, 6)), ((4, 0), (0, 6))]  # outer dim, uneven: the shard is the buffer
    assert Tiling.of((4, 6), rows).kind == "flat"
    cols = [((0, 4), (0, 3)), ((0, 4), (3, 3))]  # inner dim, even: one strided copy
    assert Tiling.of((4, 6), cols).kind == "even"
    assert Tiling.of((4, 6), cols[::-1]).kind == "pieces"  # out of order
    assert Tiling.of((4, 6), [((0, 4), (0, 2)), ((0, 4), (2, 4))]).kind == "pieces"  # inner, uneven
    assert Tiling.of((1, 6), [((0, 1), (0, 3)), ((0, 1), (3, 3))]).kind == "flat"  # leading 1s: back to back


def test_a_contiguous_outer_tiling_packs_without_a_copy():
    t = torch.randn(6, 4)
    packed = Tiling.of((6, 4), [((0, 3), (0, 4)), ((3, 3), (0, 4))]).packer()(t, _scratch())
    assert packed.data_ptr() == t.data_ptr()
