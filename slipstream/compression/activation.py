"""Activation quantization: the input of a compressed layer fake-quantized before the layer uses it.

The range of the levels (the formula of quantize.py) comes from the input itself (`range_calibration:
dynamic`: one range per row of a Linear's input, i.e. per token, and one per sample of a Conv2d's) or from a
running range kept in the layer (`static`): while training, each input's min and max move it with momentum
0.95 (the first input sets it), and in eval the stored range is used as it is. The gradient passes straight
through to the input.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.compression.plan import ActivationPlan
from slipstream.compression.quantize import round_to_levels

__all__ = ["InputQuantizer", "quantize_inputs"]

RANGE_MOMENTUM = 0.95
"""The weight of the stored range against each new input's in static calibration (DeepSpeed's)."""


class InputQuantizer(nn.Module):
    """Fake-quantizes what it is given at `bits` once `enabled` (the scheduler turns it on at the offset)."""

    running_range: torch.Tensor
    """static calibration: (min, max) of the inputs seen in training; (0, 0) until the first one (a buffer)."""

    def __init__(self, plan: ActivationPlan, bits: int, *, per_sample: bool, device: torch.device) -> None:
        super().__init__()
        self.bits, self.symmetric, self.static = bits, plan.symmetric, plan.static
        self.per_sample, self.enabled = per_sample, False
        self.register_buffer("running_range", torch.zeros(2, device=device))

    def _observe(self, x: torch.Tensor) -> None:
        low, high = x.detach().min(), x.detach().max()
        with torch.no_grad():
            if self.running_range[0] == self.running_range[1]:
                self.running_range.copy_(torch.stack([low, high]))
            self.running_range.mul_(RANGE_MOMENTUM).add_(torch.stack([low, high]), alpha=1 - RANGE_MOMENTUM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if self.static:
            if self.training:
                self._observe(x)
            flat = x.detach().reshape(1, -1)
            low, high = self.running_range[0].to(x.dtype), self.running_range[1].to(x.dtype)
        else:
            rows = x.shape[0] if self.per_sample else x.numel() // x.shape[-1]
            flat = x.detach().reshape(rows, -1)
            low, high = flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
        quantized = round_to_levels(flat, low, high, self.bits, symmetric=self.symmetric).reshape(x.shape)
        return x + (quantized - x).detach()

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"bits={self.bits}, {kind}, {'static' if self.static else 'dynamic'}, enabled={self.enabled}"


def _quantize_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    quantizer = module.input_quantizer
    assert isinstance(quantizer, InputQuantizer)
    return (quantizer(args[0]), *args[1:])


def quantize_inputs(layer: nn.Module, quantizer: InputQuantizer) -> None:
    """Give `layer` `quantizer` as its `input_quantizer`, run on its input before each forward (a forward
    pre-hook). A compressed layer gets it from init_compression; the plain layer redundancy_clean bakes from it
    gets the same one (DeepSpeed's cleaned layer keeps quantizing its input)."""
    layer.input_quantizer = quantizer
    layer.register_forward_pre_hook(_quantize_input)
