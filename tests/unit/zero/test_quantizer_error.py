"""The error of ZeRO++'s block quantizer (zero/quantized.py) measured on random tensors: at int8 and int4, with
blocks of 256, every element within absmax / (2^bits - 1) of its block (half a step of a grid that uses all
2^bits codes), the rounding unbiased (round to nearest, not toward zero or down), and the scales the fp32
quotient of the block's largest magnitude, whatever the input's dtype."""

from __future__ import annotations

import pytest
import torch

from slipstream.zero.quantized import QuantizedRows

SPEC_BLOCK = 256  # the block the bound is stated for (a coarser block would break it)


def _samples(numel: int, seed: int) -> torch.Tensor:
    """Normal values whose scale changes every 97 elements over four decades, one all-zero block, and blocks
    whose largest magnitude is negative as often as positive."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen)
    values *= torch.logspace(-3, 1, numel // 97 + 1).repeat_interleave(97)[:numel]
    values[SPEC_BLOCK : 2 * SPEC_BLOCK] = 0.0
    return values


def _round_trip(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized values, the row's fp32 scales)."""
    layout = QuantizedRows(values.numel(), bits=bits, tagged=False)
    row = torch.zeros(1, layout.row_bytes, dtype=torch.int8)
    layout.encode(values, row[0], None, torch.empty(layout.padded))
    out = layout.decode(row, torch.empty(layout.padded))[0].clone()
    return out, row[0, layout.code_bytes :].view(torch.float32).clone()


def _block_max(values: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(-(-values.numel() // SPEC_BLOCK) * SPEC_BLOCK)
    padded[: values.numel()] = values.float().abs()
    return padded.view(-1, SPEC_BLOCK).amax(dim=1)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_within_half_a_step_of_the_full_code_grid(bits: int) -> None:
    values = _samples(400 * SPEC_BLOCK + 77, seed=bits)
    out, _ = _round_trip(values, bits)
    block_max = _block_max(values).repeat_interleave(SPEC_BLOCK)[: values.numel()]
    ratio = torch.where(block_max > 0, (out - values).abs() / block_max, torch.zeros_like(block_max))
    worst = float(ratio.max())
    # fp32 arithmetic adds a few ulps of the scale times the largest code: 1e-4 of the bound covers it
    assert worst <= (1 + 1e-4) / (2**bits - 1), f"int{bits}: max |error| / block max {worst}, > 1/{2**bits - 1}"
    assert worst > 0.9 / (2**bits - 1)  # the measurement reaches the bound (it is the worst case, not loose)
    assert bool((out[SPEC_BLOCK : 2 * SPEC_BLOCK] == 0).all())  # a zero block stays exact


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_is_unbiased(bits: int) -> None:
    values = _samples(400 * SPEC_BLOCK, seed=10 + bits)
    out, scales = _round_trip(values, bits)
    steps = scales.repeat_interleave(SPEC_BLOCK)[: values.numel()]
    live = steps > 0
    in_steps = (out - values)[live] / steps[live]
    assert abs(float(in_steps.mean())) < 0.01, f"int{bits}: mean error {float(in_steps.mean())} steps"
    assert float(in_steps.abs().max()) <= 0.5 * (1 + 1e-4)  # to the nearest code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
def test_scales_are_the_fp32_quotient(bits: int, dtype: torch.dtype) -> None:
    values = _samples(40 * SPEC_BLOCK, seed=20 + bits).to(dtype)
    _, scales = _round_trip(values, bits)
    want = _block_max(values) / (2.0 ** (bits - 1) - 0.5)
    assert scales.dtype == torch.float32 and torch.equal(scales, want), float((scales - want).abs().max())
