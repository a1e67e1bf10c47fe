"""A tensorwise Float8Linear whose `precast` slot holds a float8 weight (as ZeRO-3's float8 all-gather leaves it)
multiplies that weight as it is, in the forward and in the input's gradient, instead of casting its own; an
empty slot, or a rowwise layer, casts the layer's weight; `float8_gather_slots` names the tensorwise layers'
weights only."""

from __future__ import annotations

import torch
from torch import nn

from slipstream.fp8 import Float8Linear
from slipstream.precision.fp8 import E4M3, float8_gather_slots, quantize_fp8


def _run(layer: Float8Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    out = layer(x)
    out.square().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    return out.detach(), x.grad, layer.weight.grad.clone()


def _layers(recipe: str) -> tuple[Float8Linear, Float8Linear]:
    torch.manual_seed(0)
    own = Float8Linear.from_float(nn.Linear(32, 48), recipe=recipe, emulate=True)
    other = Float8Linear.from_float(nn.Linear(32, 48), recipe=recipe, emulate=True)
    other.bias = own.bias
    return own, other


def test_a_filled_slot_is_the_weight_the_products_use() -> None:
    own, other = _layers("tensorwise")
    x = torch.randn(5, 32)
    expected_out, expected_grad_x, _ = _run(other, x)
    plain_out, _, plain_grad_w = _run(own, x)
    values, scale = quantize_fp8(other.weight.detach(), E4M3, None)
    own.precast.fill(values, scale)
    out, grad_x, grad_w = _run(own, x)
    assert torch.equal(out, expected_out)
    assert torch.equal(grad_x, expected_grad_x)
    assert not torch.equal(out, plain_out)
    own.precast.empty()
    assert torch.equal(_run(own, x)[0], plain_out)
    assert grad_w.shape == plain_grad_w.shape


def test_rowwise_layers_ignore_the_slot_and_only_tensorwise_weights_gather_in_float8() -> None:
    own, other = _layers("rowwise")
    x = torch.randn(5, 32)
    plain_out = _run(own, x)[0]
    own.precast.fill(*quantize_fp8(other.weight.detach(), E4M3, None))
    assert torch.equal(_run(own, x)[0], plain_out)
    model = nn.ModuleDict(
        {
            "tensorwise": Float8Linear(32, 48, recipe="tensorwise", emulate=True),
            "rowwise": Float8Linear(32, 48, recipe="rowwise", emulate=True),
            "odd": Float8Linear(13, 48, recipe="tensorwise", emulate=True),
            "plain": nn.Linear(32, 48),
        }
    )
    slots = float8_gather_slots(model)
    assert slots == {id(model["tensorwise"].weight): model["tensorwise"].precast}
