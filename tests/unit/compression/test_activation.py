"""Activation quantization and topk sparse pruning on CPU, one process: quantized inputs against the formula
written out here (dynamic ranges per token / per sample, static running ranges with DeepSpeed's momentum), the
schedule offset, redundancy_clean keeping the input quantization, and topk element masks against known scores."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from slipstream.compression import (
    CompressedConv2d,
    CompressedLinear,
    compression_scheduler,
    init_compression,
    redundancy_clean,
)


def _config(bits: int, *, kind: str = "symmetric", calibration: str = "dynamic", offset: int = 0) -> dict[str, object]:
    shared = {"enabled": True, "quantization_type": kind, "range_calibration": calibration, "schedule_offset": offset}
    groups = {"aq1": {"params": {"bits": bits}, "modules": ["fc1", "conv"]}}
    section = {"activation_quantization": {"shared_parameters": shared, "different_groups": groups}}
    return {"train_batch_size": 1, "compression_training": section}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc1, self.fc2 = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _rounded(row: list[float], low: float, high: float, bits: int, symmetric: bool) -> list[float]:
    """DeepSpeed's documented quantizer for one range, element by element."""
    q = 2**bits
    if symmetric:
        scale = 2 * max(abs(low), high) / q
        return [min(max(round(v / scale), -q // 2), q // 2 - 1) * scale for v in row]
    scale = (high - low) / q
    zero = round(low / scale) * scale
    return [min(max(round((v - zero) / scale), 0), q - 1) * scale + zero for v in row]


def _per_row(x: torch.Tensor, rows: int, bits: int, symmetric: bool) -> torch.Tensor:
    out = [_rounded(r, min(r), max(r), bits, symmetric) for r in x.reshape(rows, -1).tolist()]
    return torch.tensor(out).reshape(x.shape)


@pytest.mark.parametrize("bits,kind", [(8, "symmetric"), (4, "symmetric"), (8, "asymmetric"), (4, "asymmetric")])
def test_dynamic_ranges_per_token_and_per_sample(bits: int, kind: str) -> None:
    config = _config(bits, kind=kind)
    model = init_compression(_Net(), config)
    assert isinstance(model.fc1, CompressedLinear) and isinstance(model.conv, CompressedConv2d)
    assert not isinstance(model.fc2, CompressedLinear)
    compression_scheduler(model, config).step(step_zero_check=True)
    x = torch.randn(2, 4, 6) * 3
    expected = _per_row(x, 8, bits, kind == "symmetric")  # one range per token: 2 * 4 rows of 6
    torch.testing.assert_close(model.fc1(x), nn.functional.linear(expected, model.fc1.weight, model.fc1.bias))
    images = torch.randn(3, 2, 4, 4)
    expected = _per_row(images, 3, bits, kind == "symmetric")  # one range per sample
    torch.testing.assert_close(
        model.conv(images), model.conv._conv_forward(expected, model.conv.weight, model.conv.bias)
    )


@pytest.mark.parametrize("kind", ["symmetric", "asymmetric"])
def test_static_range_moves_with_momentum_and_is_kept_in_eval(kind: str) -> None:
    config = _config(8, kind=kind, calibration="static")
    model = init_compression(_Net(), config)
    compression_scheduler(model, config).step(step_zero_check=True)
    quantizer = model.fc1.input_quantizer
    first, second = torch.randn(4, 6), torch.randn(4, 6) * 2 + 1
    model.fc1(first)  # the first input sets the range
    low, high = first.min().item(), first.max().item()
    torch.testing.assert_close(quantizer.running_range, torch.tensor([low, high]))
    out = model.fc1(second)
    low, high = 0.95 * low + 0.05 * second.min().item(), 0.95 * high + 0.05 * second.max().item()
    torch.testing.assert_close(quantizer.running_range, torch.tensor([low, high]))
    expected = torch.tensor([_rounded(r, low, high, 8, kind == "symmetric") for r in second.tolist()])
    torch.testing.assert_close(out, nn.functional.linear(expected, model.fc1.weight, model.fc1.bias))
    model.eval()
    wide = torch.randn(4, 6) * 10  # in eval the stored range quantizes it (clamped), and stays
    expected = torch.tensor([_rounded(r, low, high, 8, kind == "symmetric") for r in wide.tolist()])
    torch.testing.assert_close(model.fc1(wide), nn.functional.linear(expected, model.fc1.weight, model.fc1.bias))
    torch.testing.assert_close(quantizer.running_range, torch.tensor([low, high]))


def test_schedule_offset_and_straight_through_gradient() -> None:
    config = _config(4, offset=2)
    model = init_compression(_Net(), config)
    scheduler = compression_scheduler(model, config)
    x = torch.randn(3, 6, requires_grad=True)
    dense = nn.functional.linear(x, model.fc1.weight, model.fc1.bias)
    scheduler.step(step_zero_check=True)
    scheduler.step()  # step 1 < offset 2: the input as it is
    torch.testing.assert_close(model.fc1(x), dense)
    scheduler.step()
    quantized = _per_row(x.detach(), 3, 4, True)
    assert not torch.equal(quantized, x.detach())
    torch.testing.assert_close(model.fc1(x), nn.functional.linear(quantized, model.fc1.weight, model.fc1.bias))
    model.fc1(x).sum().backward()  # the input's gradient passes the quantizer unchanged
    torch.testing.assert_close(x.grad, model.fc1.weight.sum(dim=0).expand(3, 6))


def test_redundancy_clean_keeps_the_input_quantization() -> None:
    config = _config(4, calibration="static")
    model = init_compression(_Net(), config)
    compression_scheduler(model, config).step(step_zero_check=True)
    model(torch.randn(5, 6))
    model.eval()
    x = torch.randn(5, 6)
    compressed = model(x)
    cleaned = redundancy_clean(model, config)
    assert type(cleaned.fc1) is nn.Linear and cleaned.fc1.input_quantizer.enabled
    assert "fc1.input_quantizer.running_range" in cleaned.state_dict()
    torch.testing.assert_close(cleaned(x), compressed, rtol=0, atol=0)
    assert not torch.allclose(
        cleaned(x), cleaned.fc2(torch.relu(nn.functional.linear(x, cleaned.fc1.weight, cleaned.fc1.bias)))
    )


def test_activation_bits_other_than_4_or_8_name_the_group() -> None:
    with pytest.raises(ValueError, match="aq1.params.bits is 6; give 4 or 8"):
        init_compression(_Net(), _config(6))


def _topk_config(ratio: float, offset: int) -> dict[str, object]:
    section = {
        "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": offset},
        "different_groups": {"sp1": {"params": {"dense_ratio": ratio}, "modules": ["fc2"]}},
    }
    return {"train_batch_size": 1, "compression_training": {"sparse_pruning": section}}


@pytest.mark.parametrize("ratio", [0.4, 0.75])
def test_topk_sparse_mask_keeps_the_largest_scores(ratio: float) -> None:
    config = _topk_config(ratio, offset=1)
    model = init_compression(_Net(), config)
    scores = model.fc2.sparse_pruning.scores
    assert scores.shape == model.fc2.weight.shape and any(p is scores for p in model.parameters())
    values = [((i * 7) % 15) - 7.5 for i in range(15)]  # distinct, in a known order
    with torch.no_grad():
        scores.copy_(torch.tensor(values).view(3, 5))
    keep = math.ceil(ratio * 15)
    ranked = sorted(range(15), key=lambda i: -values[i])[:keep]
    expected = torch.tensor([1.0 if i in ranked else 0.0 for i in range(15)]).view(3, 5)
    weight = model.fc2.weight.detach().clone()
    scheduler = compression_scheduler(model, config)
    scheduler.step(step_zero_check=True)
    torch.testing.assert_close(model.fc2.compressed_weight(), weight)  # before the offset: dense
    scheduler.step()
    masked = model.fc2.compressed_weight()
    torch.testing.assert_close(masked, weight * expected)
    masked.sum().backward()  # straight through: each score gets its weight, kept or pruned
    torch.testing.assert_close(scores.grad, weight)
    assert (redundancy_clean(model, config).fc2.weight == weight * expected).all()
