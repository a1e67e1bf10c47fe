"""Block-wise int8 / int4 quantization of ZeRO-3 tensors: a shard for its all-gather (ZeRO++'s quantized
weights, qwZ) and the pieces of a unit's gradient in its quantized reduce-scatter (qgZ,
stage3/quantized_reduce.py).

[Note: quantized gather rows]
A vector of `numel` elements is cut into blocks of `BLOCK` elements (the last one zero-padded); each block gets
one fp32 scale, computed in fp32 from the values in fp32, and its elements are rounded to the nearest integer of
value / scale (a block of zeros has scale 0 and all-zero codes). All 2^bits codes are used: codes run from -2^(b-1)
to 2^(b-1) - 1 (-128..127, -8..7) and the scale is the block's largest magnitude / L with L = 2^(b-1) - 1/2 (127.5,
7.5), so the largest magnitude lands half a step past the last code on its side: -L rounds to the lowest code
and +L to a code that the clamp brings half a step back. Every element is thus within half a scale, absmax /
(2^bits - 1) of its block (1/255 at int8, 1/15 at int4), of the value. (L = 2^(b-1) - 1, which leaves the lowest
code unused, gives 1/254 and 1/14; DeepSpeed's L = 2^(b-1) with the same clamp can miss the largest positive
value by a whole step, 1/128 and 1/8.) One row is int8 bytes:
    [codes: padded numel x bits / 8] [scales: 4 bytes x blocks] [tag: 4 bytes, qwZ's rows only]
so a single collective of int8 carries codes, scales (and the unit tag): about a quarter of the bytes of an fp32
row at int8, an eighth at int4. int4 codes are stored as code + 8 (0..15), two per byte, the even element in
the low nibble. Dequantizing gives code x scale. A qwZ shard itself, and so the optimizer's masters, stays exact.
"""

from __future__ import annotations

import torch

BLOCK = 256
_LEVELS = {8: 127.5, 4: 7.5}  # largest magnitude / scale: half a step past the top code (see the note)
_CODES = {8: (-128.0, 127.0), 4: (-8.0, 7.0)}
_INT4_OFFSET = 8.0


class QuantizedRows:
    """The layout of one quantized row of `numel` elements at `bits` (8 or 4), with a trailing fp32 tag when
    `tagged` (see [Note: quantized gather rows])."""

    def __init__(self, numel: int, *, bits: int = 8, tagged: bool = True) -> None:
        if bits not in _LEVELS:
            raise ValueError(f"quantized rows hold 8- or 4-bit codes, not bits={bits}")
        self.numel, self.bits, self.tagged = numel, bits, tagged
        self.levels, self.codes = _LEVELS[bits], _CODES[bits]
        self.num_blocks = -(-numel // BLOCK)
        self.padded = self.num_blocks * BLOCK
        self.code_bytes = self.padded * bits // 8
        self.row_bytes = self.code_bytes + 4 * (self.num_blocks + int(tagged))

    def _floats(self, rows: torch.Tensor) -> torch.Tensor:
        """The scales (and the tag) of `rows` (int8, [rows, row_bytes]) as fp32, [rows, blocks (+ 1)]."""
        return rows[:, self.code_bytes :].view(torch.float32)

    def encode(self, values: torch.Tensor, row: torch.Tensor, tag: float | None, scratch: torch.Tensor) -> None:
        """Quantize `values` (numel elements, any shape and float dtype) into `row` (int8, row_bytes), with `tag`
        at its end when the rows are tagged (None otherwise); `scratch` is an fp32 buffer of at least `padded`
        elements (the caller's, reused)."""
        scratch = scratch[: self.padded]
        scratch[self.numel :].zero_()
        scratch[: self.numel].view(values.shape).copy_(values)
        blocks = scratch.view(self.num_blocks, BLOCK)
        scales = blocks.abs().amax(dim=1).div_(self.levels)
        divisors = torch.where(scales > 0, scales, torch.ones_like(scales))  # a block of zeros stays zeros
        blocks.div_(divisors[:, None]).round_().clamp_(*self.codes)
        codes = row[: self.code_bytes]
        if self.bits == 8:
            codes.copy_(scratch)
        else:  # two codes per byte: (even + 8) + 16 x (odd + 8), built in the odd elements' places
            pairs = scratch.view(-1, 2)
            packed = pairs[:, 1].add_(_INT4_OFFSET).mul_(16).add_(pairs[:, 0]).add_(_INT4_OFFSET)
            codes.view(torch.uint8).copy_(packed)
        floats = self._floats(row.view(1, -1))[0]
        floats[: self.num_blocks].copy_(scales)
        if self.tagged:
            floats[-1] = 0.0 if tag is None else tag

    def tags(self, rows: torch.Tensor) -> torch.Tensor:
        return self._floats(rows)[:, -1]

    def decode(self, rows: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """The dequantized values of every row of `rows` (int8, [count, row_bytes]), [count, numel] views of
        `scratch` (fp32, at least count x padded elements, the caller's)."""
        count = rows.shape[0]
        values = scratch[: count * self.padded].view(count, self.num_blocks, BLOCK)
        codes = rows[:, : self.code_bytes]
        if self.bits == 8:
            values.copy_(codes.view(count, self.num_blocks, BLOCK))
        else:
            pairs = values.view(count, self.padded // 2, 2)
            pairs[..., 0].copy_(codes.view(torch.uint8))
            pairs[..., 1].copy_(pairs[..., 0])
            pairs[..., 0].remainder_(16)  # the low nibble
            pairs[..., 1].div_(16, rounding_mode="floor")  # the high one
            values.sub_(_INT4_OFFSET)
        values.mul_(self._floats(rows)[:, : self.num_blocks, None])
        return values.view(count, self.padded)[:, : self.numel]
