"""gt.visualize: the text grid of named layouts, exactly as a user sees it."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from globaltensor.tools.visualize import layout_grid

MESH = [[0, 1], [2, 3]]


def grid(sbp, shape, ranks=MESH):
    return layout_grid(gt.Layout(gt.placement("cpu", ranks), sbp), shape)


def test_1d_even():
    assert grid(gt.split(0), (8,), [0, 1, 2, 3]) == """\
(8,) as S(0) on mesh [0, 1, 2, 3]
   0:2   2:4   4:6   6:8
 ┌─────┬─────┬─────┬─────┐
 │  0  │  1  │  2  │  3  │
 └─────┴─────┴─────┴─────┘"""


def test_2x2_s0_s1_uneven_rows():
    assert grid((gt.split(0), gt.split(1)), (5, 6)) == """\
(5, 6) as (S(0), S(1)) on mesh [[0, 1], [2, 3]]
      0:3   3:6
    ┌─────┬─────┐
0:3 │  0  │  1  │
    ├─────┼─────┤
3:5 │  2  │  3  │
    └─────┴─────┘
mesh axis 0 splits dim 0 unevenly: shards of 2 or 3 rows"""


def test_uneven_with_empty_shards():
    assert grid(gt.split(0), (3,), [0, 1, 2, 3]) == """\
(3,) as S(0) on mesh [0, 1, 2, 3]
   0:1   1:2   2:3
 ┌─────┬─────┬─────┐
 │  0  │  1  │  2  │
 └─────┴─────┴─────┘
mesh axis 0 splits dim 0 unevenly: shards of 0 or 1 elements
ranks 3 hold empty shards"""


def test_partial_and_copies():
    assert grid((gt.split(0), gt.partial_sum), (4, 4)) == """\
(4, 4) as (S(0), P) on mesh [[0, 1], [2, 3]]
      0:4
    ┌─────┐
0:2 │ 0+1 │
    ├─────┤
2:4 │ 2+3 │
    └─────┘
P: a+b is the sum of those ranks' shards; a,b are copies"""
    assert grid((gt.partial("max"), gt.broadcast), (2, 3)) == """\
(2, 3) as (P(max), B) on mesh [[0, 1], [2, 3]]
          0:3
    ┌─────────────┐
0:2 │ (0,1)+(2,3) │
    └─────────────┘
P(max): a+b is the max of those ranks' shards; a,b are copies"""


def test_nested_splits_of_one_dim():
    # mesh axis 0 cuts first, axis 1 cuts each piece further
    assert grid((gt.split(1), gt.split(1)), (2, 8)) == """\
(2, 8) as (S(1), S(1)) on mesh [[0, 1], [2, 3]]
      0:2   2:4   4:6   6:8
    ┌─────┬─────┬─────┬─────┐
0:2 │  0  │  1  │  2  │  3  │
    └─────┴─────┴─────┴─────┘"""


def test_prints_on_rank_0_only(capsys):
    def program():
        x = gt.to_global(torch.zeros(4, 2), gt.placement("cpu", [0, 1]), gt.split(0))
        return gt.visualize(x, "x")
    texts = gt.launch(program, 2)
    out = capsys.readouterr().out
    assert out.count("x (4, 2) as S(0)") == 1 and texts[0] == texts[1] and texts[0] in out


def test_errors():
    with pytest.raises(ValueError, match="1-D and 2-D"):
        grid(gt.split(0), (2, 2, 2), [0, 1])
    with pytest.raises(TypeError, match="plain tensor"):
        gt.visualize(torch.zeros(2))
