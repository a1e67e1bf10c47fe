"""`TiledLinear`: one linear layer stored as a grid of smaller linears (DeepSpeed's `runtime.zero.tiling`).

A `[out_features, in_features]` weight is cut into `out_splits` row bands and `in_splits` column bands; tile
`linears[r][c]` holds rows `out_parts[r]:out_parts[r+1]` and columns `in_parts[c]:in_parts[c+1]` (bands as
even as possible, the first ones one wider when the size does not divide). Only the last tile of a row has
a bias. The output is the same as the whole layer's: row band r is the sum over c of tile (r, c) applied to
its input columns, and the row bands are concatenated.

Under ZeRO-3 the rows are separate modules of a `ModuleList`, so each row band is its own unit
(stage3/units.py [Note: choosing units]) and only one band's weights need to be gathered at a time, which is
what the tiling is for with very large layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TiledLinear", "TiledLinearReturnBias"]


def _bands(size: int, splits: int, what: str) -> list[int]:
    if not 1 <= splits <= size:
        raise RuntimeError(
            f"TiledLinear: {what}_splits={splits} must be between 1 and {what}_features ({size}); "
            "each band needs at least one feature"
        )
    base, extra = divmod(size, splits)
    bounds = [0]
    for band in range(splits):
        bounds.append(bounds[-1] + base + (1 if band < extra else 0))
    return bounds


class TiledLinear(nn.Module):
    """`nn.Linear(in_features, out_features, bias)` as `out_splits` x `in_splits` tiles (see the module doc).

    `init_linear`: a linear layer (any module with `weight` and `bias`) whose values the tiles copy.
    `input_is_already_split`: forward takes a list of `in_splits` inputs, one per column band.
    `combine_out_splits=False`: forward returns the list of row-band outputs instead of their concatenation.
    `linear_cls` builds each tile (`linear_cls(in, out, bias=..., **kwargs)`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type[torch.nn.Linear] = nn.Linear,
        init_linear: nn.Module | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_splits, self.out_splits = in_splits, out_splits
        self.use_bias = bias
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = _bands(in_features, in_splits, "in")
        self.out_parts = _bands(out_features, out_splits, "out")
        self.linears = nn.ModuleList(
            nn.ModuleList(
                linear_cls(
                    self.in_parts[c + 1] - self.in_parts[c],
                    self.out_parts[r + 1] - self.out_parts[r],
                    bias=bias and c == in_splits - 1,
                    **kwargs,
                )
                for c in range(in_splits)
            )
            for r in range(out_splits)
        )
        if init_linear is not None:
            self.copy_params_from(init_linear)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy a whole layer's `weight` (and `bias`) into the tiles."""
        weight: Any = other.weight
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"TiledLinear.copy_params_from: weight of shape {tuple(weight.shape)}, expected "
                f"({self.out_features}, {self.in_features})"
            )
        bias: Any = getattr(other, "bias", None)
        if self.use_bias and bias is None:
            raise ValueError("TiledLinear.copy_params_from: this layer has a bias and the source has none")
        for r, row in enumerate(self.linears):
            rows = slice(self.out_parts[r], self.out_parts[r + 1])
            tiles: Any = row
            for c, tile in enumerate(tiles):
                tile.weight.copy_(weight[rows, self.in_parts[c] : self.in_parts[c + 1]])
                if tile.bias is not None:
                    tile.bias.copy_(bias[rows])

    def _inputs(self, x: Any) -> list[Any]:
        if self.input_is_already_split:
            if len(x) != self.in_splits:
                raise ValueError(f"TiledLinear: got {len(x)} input splits, expected in_splits={self.in_splits}")
            return list(x)
        return [x[..., self.in_parts[c] : self.in_parts[c + 1]] for c in range(self.in_splits)]

    def _row(self, row: nn.Module, inputs: list[object]) -> Any:
        out = None
        for tile, part in zip(row, inputs):  # type: ignore[call-overload]
            local = tile(part)
            out = local if out is None else out + local
        return out

    def forward(self, x: object) -> Any:
        inputs = self._inputs(x)
        outs = [self._row(row, inputs) for row in self.linears]
        return torch.cat(outs, dim=-1) if self.combine_out_splits else outs


class TiledLinearReturnBias(TiledLinear):
    """A `TiledLinear` whose tiles return `(output, bias)` (Megatron's delayed-bias linears): forward returns
    `(output without bias, bias or None)`, each combined over the row bands like the outputs."""

    def _row(self, row: nn.Module, inputs: list[object]) -> Any:
        out, bias = None, None
        for tile, part in zip(row, inputs):  # type: ignore[call-overload]
            local, local_bias = tile(part)
            out = local if out is None else out + local
            if local_bias is not None:
                bias = local_bias if bias is None else bias + local_bias
        return out, bias

    def forward(self, x: object) -> Any:
        inputs = self._inputs(x)
        pairs = [self._row(row, inputs) for row in self.linears]
        outs = [out for out, _ in pairs]
        biases = [bias for _, bias in pairs]
        if not self.combine_out_splits:
            return outs, biases
        bias = None if any(b is None for b in biases) else torch.cat(biases, dim=-1)
        return torch.cat(outs, dim=-1), bias
