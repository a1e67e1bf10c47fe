"""Row, head and channel pruning on CPU, one process: each mask against the rule computed here on known weights
(or known learned scores), the straight-through gradient of topk scores, the schedule offset, and
redundancy_clean's smaller model giving the masked model's output."""

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


def _config(
    method: str,
    ratio: float,
    *,
    modules: list[str],
    related: list[list[str]] | None = None,
    kind: str | None = None,
    offset: int = 2,
    heads: int | None = None,
) -> dict[str, object]:
    shared: dict[str, object] = {"enabled": True, "schedule_offset": offset}
    if kind is not None:
        shared["method"] = kind
    if heads is not None:
        shared["num_heads"] = heads
    group: dict[str, object] = {"params": {"dense_ratio": ratio}, "modules": modules}
    if related is not None:
        group["related_modules"] = related
    section = {"shared_parameters": shared, "different_groups": {"g1": group}}
    return {"train_batch_size": 1, "compression_training": {method: section}}


def _kept(values: list[float], ratio: float) -> list[float]:
    """The rule written out: 1 for the ceil(ratio * n) largest values, 0 for the others."""
    keep = math.ceil(ratio * len(values))
    order = sorted(range(len(values)), key=lambda i: -values[i])[:keep]
    return [1.0 if i in order else 0.0 for i in range(len(values))]


class _Mlp(nn.Module):
    def __init__(self, blocks: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"fc1": nn.Linear(8, 6), "fc2": nn.Linear(6, 8)}) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block["fc2"](torch.relu(block["fc1"](x)))
        return x


class _Attention(nn.Module):
    """Multi-head self-attention whose number of heads follows from its query width (head size 4)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.q, self.k, self.v = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(8, 12)
        self.o = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = self.q.out_features // 4
        q, k, v = (proj(x).view(b, s, heads, 4).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, heads * 4)
        return self.o(out)


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)))


@pytest.mark.parametrize("ratio", [0.5, 0.34, 1.0])
def test_row_l1_mask_keeps_the_rows_with_the_largest_l1_norms(ratio: float) -> None:
    model = _Mlp()
    with torch.no_grad():  # known rows: row i holds the values i-3 .. i+4 (|.| sums 16, 14, 13, 13, 14, 16)
        model.layers[0]["fc1"].weight.copy_(torch.arange(8.0).repeat(6, 1) + torch.arange(6.0).view(6, 1) - 5)
    config = _config("row_pruning", ratio, modules=["fc1"])
    model = init_compression(model, config)
    fc1 = model.layers[0]["fc1"]
    assert isinstance(fc1, CompressedLinear)
    weight, bias = fc1.weight.detach().clone(), fc1.bias.detach().clone()
    norms = [sum(abs(v) for v in row) for row in weight.tolist()]
    expected = torch.tensor(_kept(norms, ratio))
    scheduler = compression_scheduler(model, config)
    scheduler.step()  # step 1 < offset 2: dense
    torch.testing.assert_close(fc1.compressed_weight(), weight)
    scheduler.step()
    torch.testing.assert_close(fc1.compressed_weight(), weight * expected.view(-1, 1))
    torch.testing.assert_close(fc1.compressed_bias(), bias * expected)


def test_topk_row_scores_pick_rows_and_learn_straight_through() -> None:
    config = _config("row_pruning", 0.5, modules=["fc1"], kind="topk", offset=0)
    model = init_compression(_Mlp(), config)
    fc1 = model.layers[0]["fc1"]
    assert fc1.row_pruning.scores.shape == (6, 1)
    assert any(p is fc1.row_pruning.scores for p in model.parameters())  # an optimizer built now trains it
    scores = [0.3, -1.0, 2.0, 0.1, 0.5, -0.2]
    with torch.no_grad():
        fc1.row_pruning.scores.copy_(torch.tensor(scores).view(6, 1))
    compression_scheduler(model, config).step(step_zero_check=True)
    weight = fc1.weight.detach().clone()
    out = fc1.compressed_weight()
    torch.testing.assert_close(out, weight * torch.tensor(_kept(scores, 0.5)).view(-1, 1))
    out.sum().backward()  # d(sum)/d(mask_i) is row i's sum: it reaches score i unchanged, pruned rows too
    torch.testing.assert_close(fc1.row_pruning.scores.grad.view(-1), weight.sum(dim=1))


def test_head_pruning_masks_the_output_projections_input_per_head() -> None:
    config = _config("head_pruning", 0.34, modules=["o"], heads=3, offset=1)
    model = init_compression(_Attention(), config)
    assert isinstance(model.o, CompressedLinear) and not isinstance(model.q, CompressedLinear)
    scores = [0.2, 0.9, -0.5]
    with torch.no_grad():
        model.o.head_pruning.scores.copy_(torch.tensor([scores]))
    compression_scheduler(model, config).step()
    weight = model.o.weight.detach().clone()
    columns = torch.tensor(_kept(scores, 0.34)).repeat_interleave(4)  # head h owns input columns 4h .. 4h+3
    torch.testing.assert_close(model.o.compressed_weight(), weight * columns)
    torch.testing.assert_close(model.o.compressed_bias(), model.o.bias)


def test_channel_l1_mask_keeps_the_kernels_with_the_largest_l1_norms() -> None:
    config = _config("channel_pruning", 0.5, modules=["conv1"], offset=1)
    model = init_compression(_Convs(), config)
    assert isinstance(model.conv1, CompressedConv2d) and not isinstance(model.conv2, CompressedConv2d)
    weight, bias = model.conv1.weight.detach().clone(), model.conv1.bias.detach().clone()
    norms = [sum(abs(v) for v in kernel.flatten().tolist()) for kernel in weight]
    expected = torch.tensor(_kept(norms, 0.5))
    compression_scheduler(model, config).step()
    torch.testing.assert_close(model.conv1.compressed_weight(), weight * expected.view(-1, 1, 1, 1))
    torch.testing.assert_close(model.conv1.compressed_bias(), bias * expected)


def _size(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


CLEAN_CASES = {
    "rows": (lambda: _Mlp(blocks=2), _config("row_pruning", 0.5, modules=["fc1"], related=[["fc2"]], offset=1), (3, 8)),
    "heads": (
        _Attention,
        _config("head_pruning", 0.33, modules=["o"], related=[["q", "k", "v"]], heads=3, offset=1),
        (2, 8),
    ),
    "channels": (
        _Convs,
        _config("channel_pruning", 0.5, modules=["conv1"], related=[["conv2"]], offset=1),
        (1, 3, 6, 6),
    ),
}


@pytest.mark.parametrize("case", sorted(CLEAN_CASES))
def test_redundancy_clean_removes_the_pruned_units_and_keeps_the_output(case: str) -> None:
    build, config, shape = CLEAN_CASES[case]
    model = init_compression(build(), config)
    compression_scheduler(model, config).step()
    x = torch.randn(*shape) if case != "heads" else torch.randn(2, 5, 8)
    masked, before = model(x).detach(), _size(model)
    cleaned = redundancy_clean(model, config)
    assert not any(isinstance(m, (CompressedLinear, CompressedConv2d)) for m in cleaned.modules())
    torch.testing.assert_close(cleaned(x), masked, rtol=1e-5, atol=1e-6)
    assert _size(cleaned) < before
    if case == "rows":  # each block's fc1 paired with its own fc2
        assert [b["fc1"].out_features for b in cleaned.layers] == [3, 3]
        assert [b["fc2"].weight.shape for b in cleaned.layers] == [torch.Size([8, 3])] * 2
    if case == "heads":
        assert (cleaned.q.out_features, cleaned.v.bias.numel(), cleaned.o.in_features) == (4, 4, 4)
    if case == "channels":
        assert (cleaned.conv1.out_channels, cleaned.conv2.weight.shape[1]) == (3, 3)


def test_without_related_modules_pruned_rows_stay_as_zeros() -> None:
    config = _config("row_pruning", 0.5, modules=["fc1"], offset=1)
    model = init_compression(_Mlp(), config)
    compression_scheduler(model, config).step()
    x = torch.randn(3, 8)
    masked = model(x).detach()
    cleaned = redundancy_clean(model, config)
    assert cleaned.layers[0]["fc1"].out_features == 6
    assert int((cleaned.layers[0]["fc1"].weight.abs().sum(dim=1) == 0).sum()) == 3
    torch.testing.assert_close(cleaned(x), masked, rtol=0, atol=0)


def test_configuration_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="num_heads 5 does not divide the 12 input features of 'o'"):
        init_compression(_Attention(), _config("head_pruning", 0.5, modules=["o"], heads=5))
    with pytest.raises(ValueError, match="method 'l1'.*use method topk"):
        init_compression(_Attention(), _config("head_pruning", 0.5, modules=["o"], heads=3, kind="l1"))
    config = _config("row_pruning", 0.5, modules=["fc1"], related=[["fc"]], offset=0)
    model = init_compression(_Mlp(), config)
    compression_scheduler(model, config).step(step_zero_check=True)
    with pytest.raises(ValueError, match="related pattern 'fc' matches 2 modules but 'fc1' matches 1"):
        redundancy_clean(model, config)
