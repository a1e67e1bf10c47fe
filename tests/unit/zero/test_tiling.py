"""TiledLinear (DeepSpeed's `runtime.zero.tiling`): the same outputs and gradients as the whole nn.Linear it
copies, its bands and bias placement, the errors, and its rows as ZeRO-3 units."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream.zero.stage3.units import plan_units
from slipstream.zero.tiling import TiledLinear, TiledLinearReturnBias


class BiasOut(nn.Linear):
    """A Megatron-style linear that returns its bias instead of adding it."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return nn.functional.linear(x, self.weight), self.bias


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_f", "out_f", "in_splits", "out_splits"), [(32, 32, 1, 1), (23, 29, 2, 3), (29, 23, 5, 4)])
def test_matches_the_whole_layer_forward_and_backward(bias: bool, in_f: int, out_f: int, in_splits: int,
                                                       out_splits: int) -> None:
    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f, bias=bias)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=copy.deepcopy(base))
    x = torch.randn(3, in_f)
    torch.testing.assert_close(tiled(x), base(x))
    base(x).square().sum().backward()
    tiled(x).square().sum().backward()
    assert base.weight.grad is not None
    for r, row in enumerate(tiled.linears):
        rows = slice(tiled.out_parts[r], tiled.out_parts[r + 1])
        for c, tile in enumerate(row):
            cols = slice(tiled.in_parts[c], tiled.in_parts[c + 1])
            torch.testing.assert_close(tile.weight.grad, base.weight.grad[rows, cols])
            assert (tile.bias is not None) == (bias and c == in_splits - 1)  # only the last tile of a row
            if tile.bias is not None:
                assert base.bias is not None and base.bias.grad is not None
                torch.testing.assert_close(tile.bias.grad, base.bias.grad[rows])


def test_bands_split_inputs_and_outputs() -> None:
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False)
    assert tiled.in_parts == [0, 4, 7, 10] and tiled.out_parts == [0, 4, 7]  # the first bands one wider
    outs = tiled([torch.ones(1, 4), torch.ones(1, 3), torch.ones(1, 3)])
    assert [tuple(o.shape) for o in outs] == [(1, 4), (1, 3)]
    with pytest.raises(ValueError, match="got 2 input splits, expected in_splits=3"):
        tiled([torch.ones(1, 4), torch.ones(1, 3)])


@pytest.mark.parametrize(("in_splits", "out_splits"), [(0, 1), (1, 0), (33, 1), (1, 33)])
def test_splits_outside_one_to_features_are_refused(in_splits: int, out_splits: int) -> None:
    with pytest.raises(RuntimeError, match="_splits=.* must be between 1 and"):
        TiledLinear(32, 32, in_splits=in_splits, out_splits=out_splits)


def test_return_bias_variant_matches_a_bias_returning_linear() -> None:
    torch.manual_seed(1)
    base = BiasOut(12, 10)
    tiled = TiledLinearReturnBias(12, 10, in_splits=2, out_splits=3, linear_cls=BiasOut, init_linear=copy.deepcopy(base))
    x = torch.randn(2, 12)
    out, bias = tiled(x)
    want_out, want_bias = base(x)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(bias, want_bias)
    no_bias = TiledLinearReturnBias(12, 10, bias=False, in_splits=2, out_splits=2, linear_cls=BiasOut)
    assert no_bias(x)[1] is None


def test_rows_are_zero3_units() -> None:
    model = nn.Sequential(nn.Linear(4, 8), TiledLinear(8, 6, in_splits=2, out_splits=3))
    names = [spec.name for spec in plan_units(model, threshold=0)]
    assert names == ["0", "1.linears.0", "1.linears.1", "1.linears.2", "<root>"]
