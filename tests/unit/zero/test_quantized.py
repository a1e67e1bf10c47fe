"""Block-wise int8 quantization of gather rows (zero/quantized.py): every element within half a scale of its
value, zero blocks exact, the tag carried, and a row a quarter of fp32's bytes; int4 rows use all 16 codes, two a
byte."""

from __future__ import annotations

import torch

from slipstream.zero.quantized import BLOCK, QuantizedRows


def _bound(values: torch.Tensor, padded: int) -> torch.Tensor:
    """Half a scale per element: the block's largest magnitude / 255."""
    blocks = torch.zeros(padded)
    blocks[: values.numel()] = values.float()
    return (blocks.view(-1, BLOCK).abs().amax(dim=1) / 255).repeat_interleave(BLOCK)[: values.numel()]


def test_rows_round_trip_within_half_a_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    numel = 3 * BLOCK + 17  # a partial last block
    rows_layout = QuantizedRows(numel)
    shards = [torch.randn(numel, generator=gen) * 0.01, torch.zeros(numel)]
    shards[0][BLOCK : 2 * BLOCK] = 0.0  # one all-zero block inside a shard
    rows = torch.zeros(2, rows_layout.row_bytes, dtype=torch.int8)
    scratch = torch.empty(rows_layout.padded)
    for r, shard in enumerate(shards):
        rows_layout.encode(shard.to(torch.bfloat16) if r else shard, rows[r], 5.0 + r, scratch)
    out = rows_layout.decode(rows, torch.empty(2 * rows_layout.padded))
    assert rows_layout.tags(rows).tolist() == [5.0, 6.0]
    for r, shard in enumerate(shards):
        error = (out[r] - shard).abs()
        assert bool((error <= _bound(shard, rows_layout.padded) * (1 + 1e-4)).all()), float(error.max())
    assert bool((out[0][BLOCK : 2 * BLOCK] == 0).all()) and bool((out[1] == 0).all())
    assert QuantizedRows(100_000).row_bytes < 100_000 * 4 / 3.9  # about a quarter of an fp32 row


def test_int4_rows_pack_two_codes_a_byte_within_half_a_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    numel = 2 * BLOCK + 31
    layout = QuantizedRows(numel, bits=4, tagged=False)
    assert layout.row_bytes == layout.padded // 2 + 4 * layout.num_blocks  # codes two a byte, one scale a block
    values = torch.randn(numel, generator=gen)
    values[:15] = torch.arange(-7.0, 8.0)  # the codes -7..7, scale 1 (largest magnitude 7.5) in the first block
    values[15] = -7.5  # the largest magnitude, half a step past -7: the code -8
    values[16:BLOCK] = 0.0
    rows = torch.zeros(1, layout.row_bytes, dtype=torch.int8)
    layout.encode(values, rows[0], None, torch.empty(layout.padded))
    out = layout.decode(rows, torch.empty(layout.padded))[0]
    assert torch.equal(out[:15], values[:15]) and float(out[15]) == -8.0  # every code, nibbles in place
    assert torch.equal(out[16:BLOCK], values[16:BLOCK])
    blocks = torch.zeros(layout.padded)
    blocks[:numel] = values
    bound = (blocks.view(-1, BLOCK).abs().amax(dim=1) / 15).repeat_interleave(BLOCK)[:numel]
    assert bool(((out - values).abs() <= bound * (1 + 1e-4)).all())
    assert not torch.equal(out, values)
