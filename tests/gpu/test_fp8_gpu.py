"""FP8 linear layers through torch._scaled_mm on a GPU with FP8 (compute capability 8.9 or later): a small
model converted without emulation takes a training step, and its output and gradients agree with the
emulated float8 computation of the same scaled values (the same rounding; only the accumulation differs).
Marked `gpu`; skipped with the reason on a card without FP8. tools/gpu_check.sh runs it as its FP8 row."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream.fp8 import Float8Linear, convert_to_float8_training, fp8_hardware

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_converted_model_steps_with_scaled_mm(recipe: str) -> None:
    if not fp8_hardware():
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        pytest.skip(f"FP8 check skipped: {name} has no FP8 matmul (needs compute capability 8.9 or later)")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).cuda().to(torch.bfloat16)
    emulated = convert_to_float8_training(copy.deepcopy(model), recipe=recipe, emulate=True)
    convert_to_float8_training(model, recipe=recipe)
    assert all(isinstance(model[i], Float8Linear) and not model[i].emulate for i in (0, 2))
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)  # 40 tokens: the weight gradient pads to 48
    results = []
    for net in (model, emulated):
        out = net(x)
        out.float().square().mean().backward()
        results.append((out.float(), net[0].weight.grad.float(), net[2].weight.grad.float()))
    for hardware, emulation in zip(*results):
        assert torch.isfinite(hardware).all()
        assert torch.allclose(hardware, emulation, rtol=2e-2, atol=2e-2 * emulation.abs().max().item())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model[0].weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model[0].weight)
