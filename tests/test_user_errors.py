"""Issue 17 item 3: warnings name the user's line, and a wrong call is reported as the kernel's error
with the op and the inputs' layouts, never first as a "no SBP rule" fallback warning."""
import warnings

import pytest
import torch

import globaltensor as gt
from globaltensor.ops import dispatch


def _matmul_of_mismatched_shapes():
    a = gt.to_global(torch.randn(2, 3), gt.placement("cpu", [0, 1]), gt.split(0))
    return a @ a


def test_a_shape_error_is_the_kernels_error_with_op_and_layouts():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError) as e:
            gt.launch(_matmul_of_mismatched_shapes, 2)
    text = str(e.value)
    assert "aten.mm.default" in text and "cannot be multiplied" in text, text
    assert "(2, 3) float32 (S(0),)" in text and "placement('cpu', [0, 1])" in text, text
    assert not [w for w in caught if "no SBP rule" in str(w.message)], [str(w.message) for w in caught]


def _bad_view():
    x = gt.to_global(torch.arange(6.0), gt.placement("cpu", [0, 1]), gt.split(0))
    return x.view(4, 2)


def test_a_bad_view_is_reported_with_its_layouts():
    with pytest.raises(RuntimeError, match=r"aten.view.default.*invalid for input of size 6.*\(6,\) float32 \(S\(0\),\)"):
        gt.launch(_bad_view, 2)


def _embedding_index_out_of_range():
    mesh = gt.placement("cpu", [0, 1])
    emb = gt.to_global(torch.nn.Embedding(4, 3), mesh, {})
    return emb(gt.to_global(torch.tensor([1, 7]), mesh, gt.split(0)))


def test_an_error_only_the_values_show_names_the_op_the_rank_and_the_layouts():
    with pytest.raises(IndexError) as e:
        gt.launch(_embedding_index_out_of_range, 2)
    text = str(e.value)
    assert "aten.embedding.default: index out of range" in text and "on rank 1's shards" in text, text
    assert "#1 (2,) int64 (S(0),)" in text and e.value.rank == 1, text


def test_a_fallback_warning_names_the_users_line():
    dispatch._WARNED.discard("aten.median.default")  # warned once per op and process

    def program():
        x = gt.to_global(torch.arange(6.0), gt.placement("cpu", [0, 1]), gt.split(0))
        torch.ops.aten.median.default(x)  # an op without a rule: replicated, warned
    with warnings.catch_warnings(record=True) as caught:  # in this thread: the ranks' threads share the filters
        warnings.simplefilter("always")
        gt.launch(program, 2)
    got = [(w.filename, str(w.message)) for w in caught if "no SBP rule" in str(w.message)]
    gt.reset_stats()  # the counted fallback is this test's, not the next one's
    assert got and all(f == __file__ for f, _ in got), got
