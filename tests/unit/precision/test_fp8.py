"""FP8 linear layers in emulation: the scales are the formula, the forward and both gradients stay within the
error float8 rounding allows, and nn.Linear modules are swapped as torchao swaps them.

The bound: e4m3 keeps 3 mantissa bits, so rounding a normal value errs by at most 2^-4 of it (e5m2: 2 bits,
2^-3); below the smallest normal (2^-6 for e4m3, 2^-14 for e5m2, in scaled units) the error is at most half
the subnormal step (2^-10, 2^-17), divided back by the scale. Each operand's element error is therefore at
most e = u|v| + d/scale, and a product's error at most e_a|b| + |a|e_b + e_a e_b summed over the contraction.
A per-row scale is never smaller than the tensor's, so the per-tensor bound holds for both recipes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.fp8 import Float8Linear, convert_to_float8_training, fp8_hardware
from slipstream.precision import fp8 as fp8_module
from slipstream.precision.fp8 import E4M3, E5M2, fp8_scale

FORMATS = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}


def _element_error(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    u, half_subnormal = FORMATS[dtype]
    return u * v.abs() + half_subnormal / fp8_scale(v, dtype, None)


def _product_bound(a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_dtype: torch.dtype) -> torch.Tensor:
    """The largest error of a @ b.T with both operands rounded to their float8 formats (plus fp32 noise)."""
    ea, eb = _element_error(a, a_dtype), _element_error(b, b_dtype)
    bound = ea @ b.abs().t() + a.abs() @ eb.t() + ea @ eb.t()
    return bound + 1e-5 * (a.abs() @ b.abs().t())


def _layer_and_reference(recipe: str) -> tuple[Float8Linear, nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    reference = nn.Linear(32, 48)
    layer = Float8Linear.from_float(nn.Linear(32, 48), recipe=recipe, emulate=True)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(3, 7, 32) * torch.logspace(-2, 1, 7).view(1, 7, 1)  # rows of different magnitudes
    return layer, reference, x, torch.randn(3, 7, 48)


def _run(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_(True)
    out = layer(leaf)
    out.backward(grad)
    assert leaf.grad is not None and layer.weight.grad is not None
    return out.detach(), leaf.grad, layer.weight.grad


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_and_gradients_within_the_float8_bound(recipe: str) -> None:
    layer, reference, x, grad = _layer_and_reference(recipe)
    out, grad_x, grad_w = _run(layer, x, grad)
    ref_out, ref_x, ref_w = _run(reference, x, grad)
    x2, g2, w = x.reshape(-1, 32), grad.reshape(-1, 48), reference.weight.detach()
    checks = {
        "output": (out.reshape(-1, 48) - ref_out.reshape(-1, 48), _product_bound(x2, E4M3, w, E4M3)),
        "input grad": (grad_x.reshape(-1, 32) - ref_x.reshape(-1, 32), _product_bound(g2, E5M2, w.t(), E4M3)),
        "weight grad": (grad_w - ref_w, _product_bound(g2.t(), E5M2, x2.t(), E4M3)),
    }
    for name, (error, bound) in checks.items():
        assert error.abs().max() > 0, f"{name}: no rounding at all, so float8 was not used"
        assert (error.abs() <= bound).all(), f"{name}: error {(error.abs() / bound).max():.2f}x the float8 bound"
    assert torch.equal(layer.bias.grad, reference.bias.grad)


def test_rowwise_scales_each_row_and_is_closer_on_uneven_rows() -> None:
    x = torch.randn(6, 32) * torch.logspace(-3, 2, 6).view(6, 1)
    assert torch.equal(fp8_scale(x, E4M3, None), 448.0 / x.abs().max())
    assert torch.equal(fp8_scale(x, E4M3, 1), 448.0 / x.abs().amax(dim=1, keepdim=True))
    assert torch.equal(fp8_scale(x, E5M2, None), 57344.0 / x.abs().max())
    errors = {}
    for recipe in ("tensorwise", "rowwise"):
        layer, reference, inputs, grad = _layer_and_reference(recipe)
        out, _, _ = _run(layer, inputs, grad)
        errors[recipe] = ((out - reference(inputs)).abs() / reference(inputs).abs().clamp(min=1e-3)).median()
    assert errors["rowwise"] < errors["tensorwise"]


def test_a_wrong_scale_breaks_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, reference, x, grad = _layer_and_reference("tensorwise")
    true_scale = fp8_module.fp8_scale
    monkeypatch.setattr(fp8_module, "fp8_scale", lambda t, dtype, axis: true_scale(t, dtype, axis) * 4)
    out = layer(x).detach().reshape(-1, 48)
    bound = _product_bound(x.reshape(-1, 32), E4M3, reference.weight.detach(), E4M3)
    assert not ((out - reference(x).detach().reshape(-1, 48)).abs() <= bound).all()


def test_convert_swaps_divisible_linears_the_filter_accepts() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 10)))
    model.append(nn.Linear(16, 32))
    weight = model[0].weight
    convert_to_float8_training(model, recipe="rowwise", module_filter_fn=lambda m, fqn: fqn != "3", emulate=True)
    kinds = [type(m).__name__ for m in (model[0], model[2][0], model[2][1], model[3])]
    assert kinds == ["Float8Linear", "Float8Linear", "Linear", "Linear"]
    assert model[0].weight is weight and model[0].recipe == "rowwise"
    with pytest.raises(ValueError, match="recipe='colwise'"):
        convert_to_float8_training(nn.Linear(16, 16), recipe="colwise", emulate=True)


@pytest.mark.skipif(fp8_hardware(), reason="this accelerator has FP8")
def test_without_fp8_hardware_only_emulation_converts() -> None:
    with pytest.raises(RuntimeError, match="has no FP8 matmul.*emulate=True"):
        convert_to_float8_training(nn.Linear(16, 16))
    with pytest.raises(RuntimeError, match="has no FP8 matmul"):
        Float8Linear(16, 16)


def test_forward_casts_to_e4m3_and_the_backward_gradient_to_e5m2(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, _, x, grad = _layer_and_reference("rowwise")
    casts: list[tuple[tuple[int, ...], torch.dtype]] = []
    quantize = fp8_module.quantize_fp8

    def recording(tensor: torch.Tensor, dtype: torch.dtype, axis: int | None):  # type: ignore[no-untyped-def]
        casts.append((tuple(tensor.shape), dtype))
        return quantize(tensor, dtype, axis)

    monkeypatch.setattr(fp8_module, "quantize_fp8", recording)
    out = layer(x.requires_grad_(True))
    assert casts == [((21, 32), E4M3), ((48, 32), E4M3)]
    out.backward(grad)
    assert casts[2:] == [((21, 48), E5M2), ((32, 48), E4M3), ((48, 21), E5M2), ((32, 21), E4M3)]
