"""Fake quantization and magnitude masks of weights, as DeepSpeed's compression library computes them.

Per group (the weight flattened into `groups` equal rows), with q = 2**bits:
- symmetric: scale = 2 * max|w| / q; w_q = clamp(round(w / scale), -q/2, q/2 - 1) * scale
- asymmetric: scale = (max w - min w) / q; zero = round(min w / scale) * scale;
  w_q = clamp(round((w - zero) / scale), 0, q - 1) * scale + zero
Stochastic rounding adds uniform noise in [-0.5, 0.5) before rounding. The gradient passes straight through.
"""

from __future__ import annotations

import torch

from slipstream.compression.masks import keep_largest

__all__ = ["fake_quantize", "l1_mask", "round_to_levels"]


def round_to_levels(
    flat: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    bits: int,
    *,
    symmetric: bool,
    noise: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """Each row of `flat` rounded to 2**bits levels over the range [low, high] (one value per row, or one for
    all): the formula in this module's docstring, where max|w| is max(|low|, high)."""
    q_range = 2**bits
    if symmetric:
        scale = 2 * torch.maximum(low.abs(), high) / q_range
        return (flat / scale + noise).round().clamp(-(q_range // 2), q_range // 2 - 1) * scale
    scale = (high - low) / q_range
    zero = (low / scale).round() * scale
    return ((flat - zero) / scale + noise).round().clamp(0, q_range - 1) * scale + zero


def _quantized(weight: torch.Tensor, bits: int, groups: int, symmetric: bool, stochastic: bool) -> torch.Tensor:
    if weight.numel() % groups:
        raise ValueError(
            f"compression_training.weight_quantization.shared_parameters.quantize_groups {groups} "
            f"does not divide a weight of {weight.numel()} elements {tuple(weight.shape)}; "
            "give a divisor of every quantized weight's size"
        )
    flat = weight.reshape(groups, -1)
    noise = torch.rand_like(flat) - 0.5 if stochastic else 0.0
    low, high = flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
    return round_to_levels(flat, low, high, bits, symmetric=symmetric, noise=noise).reshape(weight.shape)


def fake_quantize(
    weight: torch.Tensor, bits: int, groups: int, *, symmetric: bool, stochastic: bool = False
) -> torch.Tensor:
    """`weight` rounded to `bits` per group; in backward the gradient passes through unchanged."""
    with torch.no_grad():
        quantized = _quantized(weight.detach(), bits, groups, symmetric, stochastic)
    return weight + (quantized - weight).detach()


def l1_mask(weight: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """1 at the ceil(dense_ratio * numel) largest |weight| entries, 0 elsewhere (ties: sort order)."""
    return keep_largest(weight.detach().abs(), dense_ratio)
