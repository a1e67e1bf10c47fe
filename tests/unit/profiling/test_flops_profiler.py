"""The FLOPs profiler against analytic counts: one MAC of a matmul-class op is 2 FLOPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.profiling.flops_profiler import FlopsProfiler, get_model_profile, number_to_string, training_flops


def _flops(model: nn.Module, *args: torch.Tensor) -> int:
    flops, macs, params = get_model_profile(model, args=list(args), print_profile=False, as_string=False, warm_up=0)
    assert macs * 2 == flops and params == sum(p.numel() for p in model.parameters())
    return int(flops)


def test_linear_is_two_flops_per_multiply_add() -> None:
    assert _flops(nn.Linear(32, 24), torch.randn(5, 32)) == 2 * 5 * 32 * 24


def test_conv2d_counts_every_output_position() -> None:
    conv = nn.Conv2d(3, 8, kernel_size=3, stride=1, padding=1)
    batch, height, width = 2, 10, 12
    assert _flops(conv, torch.randn(batch, 3, height, width)) == 2 * batch * 8 * height * width * 3 * 3 * 3


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_sdpa_is_two_matmuls_over_the_whole_score_matrix() -> None:
    b, h, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    assert _flops(_Attention(), q, k, v) == 2 * (2 * b * h * s * s * d)  # q @ k^T, then p @ v


class _Block(nn.Module):
    """A pre-norm transformer block: fused qkv, SDPA, output projection, 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
        x = x + self.proj(attention)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def test_small_transformer_matches_the_analytic_count_per_module() -> None:
    b, s, w, heads, layers = 2, 12, 32, 4, 2
    model = nn.Sequential(*[_Block(w, heads) for _ in range(layers)])
    tokens = b * s
    per_block_linear = 2 * tokens * (w * 3 * w + w * w + w * 4 * w + 4 * w * w)
    per_block_attention = 2 * (2 * b * heads * s * s * (w // heads))
    assert _flops(model, torch.randn(b, s, w)) == layers * (per_block_linear + per_block_attention)

    profiler = FlopsProfiler(model)
    profiler.measure(lambda: model(torch.randn(b, s, w)))
    by_name = {p.name: p for p in profiler.module_profiles()}
    assert by_name["0.qkv"].flops == 2 * tokens * w * 3 * w
    assert by_name["1"].flops == per_block_linear + per_block_attention
    assert by_name["0.norm1"].flops == 0 and by_name["0"].params == sum(p.numel() for p in model[0].parameters())
    assert all(p.latency_s > 0 for p in by_name.values())
    text = profiler.render(module_depth=1, top_modules=2)
    assert "0 (_Block)" in text and "0.qkv" not in text  # depth 1 hides the blocks' children


def test_figures_as_strings_and_training_flops() -> None:
    flops, macs, params = get_model_profile(nn.Linear(1000, 1000), input_shape=(4, 1000), print_profile=False)
    assert (flops, macs, params) == ("8.00 MFLOPS", "4.00 MMACs", "1.00 M")
    assert number_to_string(999) == "999" and number_to_string(1.5e12, "FLOPS") == "1.50 TFLOPS"
    assert training_flops(100) == 300 and training_flops(100, recompute_fwd_factor=1.0) == 400


def test_profile_is_printed_to_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "profile.txt"
    get_model_profile(nn.Linear(8, 8), input_shape=(2, 8), output_file=str(out))
    assert "Forward FLOPs:                   256 FLOPs" in out.read_text()
