"""init_inference(dtype=torch.int8): every linear layer's weight in int8 per output row, within half a step of the
original (plus the fp16 rounding of the step); the rest in fp16; outputs close to the fp16 model's; int8 with tensor parallelism refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slipstream
from slipstream.inference.quantize import Int8Linear


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 40), nn.GELU(), nn.LayerNorm(40), nn.Linear(40, 8, bias=False))


def test_int8_weights_within_half_a_step_and_outputs_close() -> None:
    original = _model()
    weights = [m.weight.detach().clone() for m in original if isinstance(m, nn.Linear)]
    engine = slipstream.init_inference(_model(), dtype=torch.int8)
    layers = [m for m in engine.module if isinstance(m, Int8Linear)]
    assert len(layers) == 2 and not any(isinstance(m, nn.Linear) for m in engine.module.modules())
    for layer, weight in zip(layers, weights):
        assert layer.weight_int8.dtype == torch.int8 and layer.scale.shape == (weight.shape[0], 1)
        assert bool((layer.weight_int8.abs().amax(dim=1) == 127).all())  # each row spans the int8 range
        error = (layer.dequantized(torch.float32) - weight).abs()
        assert bool((error <= 0.6 * layer.scale.float()).all()), float((error / layer.scale.float()).max())
    assert {p.dtype for p in engine.parameters()} == {torch.float16}
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = original.to(torch.float16)(x.half()).float()
        out = engine(x.half()).float()
    assert float((out - reference).abs().max()) <= 0.02 * float(reference.abs().max())
    lone = slipstream.init_inference(nn.Linear(3, 2), dtype="int8")
    assert isinstance(lone.module, Int8Linear)


def test_int8_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="int8 weights are not split over ranks"):
        slipstream.init_inference(_model(), dtype=torch.int8, tensor_parallel={"tp_size": 2})
