"""Model compression on CPU, one process: init_compression's fake-quantized weights against the formula
(symmetric and asymmetric, per group), the bit schedule against hand-computed values, l1 masks against the
rule, and redundancy_clean's plain model against the compressed one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from slipstream.compression import CompressedLinear, compression_scheduler, init_compression, redundancy_clean


def _config(
    *,
    kind: str = "symmetric",
    groups: int = 1,
    start: int = 8,
    target: int = 8,
    period: int = 1,
    offset: int = 0,
    in_forward: bool = False,
    prune: float | None = None,
) -> dict[str, object]:
    section: dict[str, object] = {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": offset,
                "quantize_groups": groups,
                "quantization_type": kind,
                "quantize_weight_in_forward": in_forward,
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": start, "target_bits": target, "quantization_period": period},
                    "modules": ["fc"],
                }
            },
        }
    }
    if prune is not None:
        section["sparse_pruning"] = {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": offset},
            "different_groups": {"sp1": {"params": {"dense_ratio": prune}, "modules": ["fc1"]}},
        }
    return {"train_batch_size": 1, "compression_training": section}


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2, self.head = nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.act(self.fc1(x))))


def _expected(weight: torch.Tensor, bits: int, groups: int, symmetric: bool) -> torch.Tensor:
    """The quantizer written out element by element from DeepSpeed's documented formula."""
    rows = weight.detach().reshape(groups, -1).tolist()
    q = 2**bits
    out = []
    for row in rows:
        if symmetric:
            scale = 2 * max(abs(v) for v in row) / q
            out.append([min(max(round(v / scale), -q // 2), q // 2 - 1) * scale for v in row])
        else:
            scale = (max(row) - min(row)) / q
            zero = round(min(row) / scale) * scale
            out.append([min(max(round((v - zero) / scale), 0), q - 1) * scale + zero for v in row])
    return torch.tensor(out, dtype=weight.dtype).reshape(weight.shape)


@pytest.mark.parametrize(
    "kind,groups,bits", [("symmetric", 1, 8), ("symmetric", 3, 4), ("asymmetric", 2, 5), ("asymmetric", 1, 3)]
)
def test_quantized_weight_equals_the_formula(kind: str, groups: int, bits: int) -> None:
    model = init_compression(_Named(), _config(kind=kind, groups=groups, start=bits, target=bits))
    assert isinstance(model.fc1, CompressedLinear) and isinstance(model.fc2, CompressedLinear)
    assert type(model.head) is nn.Linear  # not named by the group's pattern
    compression_scheduler(model, _config(kind=kind, groups=groups, start=bits, target=bits)).step()
    for layer in (model.fc1, model.fc2):
        expected = _expected(layer.weight, bits, groups, kind == "symmetric")
        torch.testing.assert_close(layer.compressed_weight(), expected, rtol=0, atol=1e-6)
        assert torch.unique(layer.compressed_weight()).numel() <= 2**bits * groups


def test_gradient_passes_straight_through() -> None:
    model = init_compression(_Named(), _config(start=4, target=4))
    compression_scheduler(model, _config(start=4, target=4)).step()
    model.fc1.weight.grad = None
    model.fc1.compressed_weight().sum().backward()
    torch.testing.assert_close(model.fc1.weight.grad, torch.ones_like(model.fc1.weight))


def test_bit_schedule_against_hand_computed_steps() -> None:
    config = _config(start=8, target=4, period=2, offset=3)
    model = init_compression(_Named(), config)
    scheduler = compression_scheduler(model, config)
    # off before the offset (step 3); then one bit less at 2, 4, 8, 16 steps past it (the period doubles)
    expected = {1: None, 2: None, 3: 8, 4: 8, 5: 7, 6: 7, 7: 6, 10: 6, 11: 5, 18: 5, 19: 4, 40: 4}
    seen = {}
    for step in range(1, 41):
        scheduler.step()
        seen[step] = model.fc1.schedule.bits if model.fc1.quantization_enabled else None
    assert {step: seen[step] for step in expected} == expected
    x = torch.randn(2, 8)
    weight = _expected(model.fc1.weight, 4, 1, True)
    torch.testing.assert_close(model.fc1(x), x @ weight.T + model.fc1.bias, rtol=0, atol=1e-5)


def test_quantize_weight_in_forward_uses_target_bits_at_once() -> None:
    config = _config(start=8, target=4, period=100, in_forward=True)
    model = init_compression(_Named(), config)
    compression_scheduler(model, config).step()
    torch.testing.assert_close(
        model.fc2.compressed_weight(), _expected(model.fc2.weight, 4, 1, True), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("ratio", [0.5, 0.3, 1.0])
def test_l1_mask_keeps_the_largest_magnitudes(ratio: float) -> None:
    config = _config(offset=2, prune=ratio)
    config["compression_training"]["weight_quantization"]["shared_parameters"]["enabled"] = False
    model = init_compression(_Named(), config)
    weight = model.fc1.weight.detach().clone()
    keep = math.ceil(ratio * weight.numel())
    threshold = weight.abs().flatten().sort(descending=True).values[keep - 1]
    torch.testing.assert_close(model.fc1.sparse_pruning_mask, (weight.abs() >= threshold).float())
    scheduler = compression_scheduler(model, config)
    scheduler.step()
    torch.testing.assert_close(model.fc1.compressed_weight(), weight)  # before the offset: dense
    scheduler.step()
    torch.testing.assert_close(model.fc1.compressed_weight(), weight * (weight.abs() >= threshold))
    assert not isinstance(model.fc2, CompressedLinear)


def test_redundancy_clean_gives_plain_linears_with_the_same_output() -> None:
    config = _config(kind="asymmetric", groups=2, start=6, target=4, period=1, prune=0.4)
    model = init_compression(_Named(), config)
    scheduler = compression_scheduler(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
    x = torch.randn(5, 8)
    compressed = model(x)
    cleaned = redundancy_clean(model, config)
    assert all(type(m) is nn.Linear for m in (cleaned.fc1, cleaned.fc2, cleaned.head))
    torch.testing.assert_close(cleaned(x), compressed, rtol=0, atol=0)
    assert (cleaned.fc1.weight == 0).sum() >= cleaned.fc1.weight.numel() - math.ceil(0.4 * 48)


def test_unbuilt_keys_are_reported_by_name() -> None:
    config = _config()
    config["compression_training"]["sparse_pruning"] = {
        "shared_parameters": {"enabled": True, "method": "snip_momentum", "block_pattern": "4x1"}
    }
    with pytest.warns(UserWarning, match="compression_training.sparse_pruning.shared_parameters.method"):
        init_compression(_Named(), config)


def test_bad_bits_name_the_group() -> None:
    with pytest.raises(ValueError, match="wq1.*target_bits 2"):
        init_compression(_Named(), _config(start=8, target=2))


def test_deepspeed_paths_reach_the_compression_api() -> None:
    import importlib

    import slipstream as deepspeed

    assert deepspeed.compression.compress.init_compression is init_compression
    assert deepspeed.compression.compress.redundancy_clean is redundancy_clean
    assert importlib.import_module("slipstream.compression.scheduler").compression_scheduler is compression_scheduler


def test_step_zero_check_starts_compression_without_counting_a_step() -> None:
    config = _config(start=6, target=4, period=1, offset=0)
    model = init_compression(_Named(), config)
    scheduler = compression_scheduler(model, config)
    assert not model.fc1.quantization_enabled
    scheduler.step(step_zero_check=True)  # what DeepSpeed's engine does before its first forward
    assert (scheduler.training_steps, model.fc1.quantization_enabled, model.fc1.schedule.bits) == (0, True, 6)
    scheduler.step()
    assert (scheduler.training_steps, model.fc1.schedule.bits) == (1, 5)


def test_weight_methods_pass_over_matched_modules_that_are_not_linear() -> None:
    """A group's pattern that also names a Conv2d: weight quantization and sparse pruning compress only the
    nn.Linear layers it names; the convolution stays as it was."""
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 4))
    model.add_module("fc_conv", nn.Conv2d(2, 2, 1))
    init_compression(model, _config(prune=0.5))
    assert isinstance(model.fc1, CompressedLinear)
    assert type(model.fc_conv) is nn.Conv2d
