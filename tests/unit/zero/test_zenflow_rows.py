"""ZenFlow's row pieces of an owned range (zero/zenflow.py `_rows_of`) put every element back where it was."""

from __future__ import annotations

import pytest
import torch

from slipstream.zero.zenflow import _rows_of


@pytest.mark.parametrize(("lo", "hi"), [(0, 35), (3, 5), (3, 14), (7, 21), (5, 33), (14, 28), (0, 0), (34, 35)])
def test_pieces_cover_the_range_in_place(lo: int, hi: int) -> None:
    rows, cols = 5, 7
    weight = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    rebuilt = torch.full((rows, cols), -1.0)
    pieces = _rows_of(lo, hi, cols, weight.reshape(-1)[lo:hi])
    for row, start, part in pieces:
        if row is None:
            rebuilt[start : start + part.shape[0]] = part
        else:
            rebuilt[row, start : start + part.numel()] = part
    inside = torch.zeros(rows * cols, dtype=torch.bool)
    inside[lo:hi] = True
    assert torch.equal(rebuilt.reshape(-1)[inside], weight.reshape(-1)[inside])
    assert (rebuilt.reshape(-1)[~inside] == -1).all()
    assert sum(1 for row, _, _ in pieces if row is None) <= 1  # whole rows come as one block
