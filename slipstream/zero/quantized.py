"""Block-wise int8 quantization of a ZeRO-3 shard for its all-gather (ZeRO++'s quantized weights, qwZ).

[Note: quantized gather rows]
A shard of `numel` elements is cut into blocks of `BLOCK` elements (the last one zero-padded); each block gets
one fp32 scale, its largest magnitude / 127, and its elements are rounded to the nearest int8 of value / scale
(a block of zeros has scale 0 and all-zero codes). One rank's row of the gathered buffer is int8 bytes:
    [codes: padded numel] [scales: 4 bytes x blocks] [tag: 4 bytes]
so a single all-gather of int8 carries codes, scales and the unit tag (about a quarter of the bytes of an fp32
row, half of a bf16 one). Dequantizing gives code x scale: every element is within half a scale, absmax / 254
of its block, of the shard's value. The shards themselves, and so the optimizer's masters, stay exact.
"""

from __future__ import annotations

import torch

BLOCK = 256
_LEVELS = 127.0


class QuantizedRows:
    """The layout of one unit's quantized gather rows (see [Note: quantized gather rows])."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.num_blocks = -(-numel // BLOCK)
        self.padded = self.num_blocks * BLOCK
        self.row_bytes = self.padded + 4 * (self.num_blocks + 1)

    def _floats(self, rows: torch.Tensor) -> torch.Tensor:
        """The scales and the tag of `rows` (int8, [world, row_bytes]) as fp32, [world, blocks + 1]."""
        return rows[:, self.padded :].view(torch.float32)

    def encode(self, shard: torch.Tensor, row: torch.Tensor, tag: float, scratch: torch.Tensor) -> None:
        """Quantize `shard` (numel elements) into `row` (int8, row_bytes) with `tag` at its end; `scratch` is an
        fp32 buffer of `padded` elements (the caller's, reused)."""
        scratch[self.numel :].zero_()
        scratch[: self.numel].copy_(shard)
        blocks = scratch.view(self.num_blocks, BLOCK)
        scales = blocks.abs().amax(dim=1).div_(_LEVELS)
        divisors = torch.where(scales > 0, scales, torch.ones_like(scales))  # a block of zeros stays zeros
        blocks.div_(divisors[:, None]).round_().clamp_(-_LEVELS, _LEVELS)
        row[: self.padded].copy_(scratch)
        floats = self._floats(row.view(1, -1))[0]
        floats[: self.num_blocks].copy_(scales)
        floats[-1] = tag

    def tags(self, rows: torch.Tensor) -> torch.Tensor:
        return self._floats(rows)[:, -1]

    def decode(self, rows: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """The dequantized shards of every rank's row, [world, numel] views of `scratch` (fp32, world x padded
        elements, the caller's)."""
        world = rows.shape[0]
        values = scratch.view(world, self.num_blocks, BLOCK)
        values.copy_(rows[:, : self.padded].view(world, self.num_blocks, BLOCK))
        values.mul_(self._floats(rows)[:, : self.num_blocks, None])
        return scratch.view(world, self.padded)[:, : self.numel]
