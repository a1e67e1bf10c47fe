"""Block-sparse attention: layouts against hand-built ones, and the block-by-block computation against dense
attention masked with the layout (values and gradients)."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    block_sparse_attention,
)


def _rows(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows], dtype=torch.int64)


def test_fixed_layouts_by_hand() -> None:
    # 6 blocks, windows of 4 (blocks 0-3, then the short window 4-5), one global block per window: block 3,
    # and in the short window block 4 + 3 = 7 pulled back to 5.
    uni = FixedSparsityConfig(num_heads=2, block=4, num_local_blocks=4, attention="unidirectional")
    expected_uni = _rows("100000", "110000", "111000", "111100", "000110", "000111")
    assert torch.equal(uni.make_layout(24), expected_uni.expand(2, 6, 6))
    bi = FixedSparsityConfig(num_heads=1, block=4, num_local_blocks=4)
    expected_bi = _rows("111101", "111101", "111101", "111101", "000111", "000111")
    assert torch.equal(bi.make_layout(24)[0], expected_bi)
    horizontal = FixedSparsityConfig(num_heads=1, block=4, num_local_blocks=2, horizontal_global_attention=True)
    # windows of 2 over 4 blocks: global blocks 1 and 3, attended by all rows and attending to all columns
    assert torch.equal(horizontal.make_layout(16)[0], _rows("1101", "1111", "0111", "1111"))
    per_head = FixedSparsityConfig(
        num_heads=2, block=4, num_local_blocks=2, different_layout_per_head=True, num_different_global_patterns=2
    )
    layout = per_head.make_layout(16)  # head 1's global blocks are the first of each window: 0 and 2
    assert torch.equal(layout[0], _rows("1101", "1101", "0111", "0111"))
    assert torch.equal(layout[1], _rows("1110", "1110", "1011", "1011"))
    assert torch.equal(DenseSparsityConfig(num_heads=3, block=4).make_layout(8), torch.ones(3, 2, 2, dtype=torch.int64))


def test_variable_layouts_by_hand() -> None:
    # windows of 1, then 2 repeated: [0], [1, 2], [3, 4], [5]; global block 3 for rows 3 on (unidirectional)
    uni = VariableSparsityConfig(
        num_heads=1, block=4, local_window_blocks=[1, 2], global_block_indices=[3], attention="unidirectional"
    )
    expected = _rows("100000", "010000", "011000", "000100", "000110", "000101")
    assert torch.equal(uni.make_layout(24)[0], expected)
    # windows of 2; global range [1, 3) attended by every row and attending to every column
    bi = VariableSparsityConfig(
        num_heads=2,
        block=4,
        local_window_blocks=[2],
        global_block_indices=[1],
        global_block_end_indices=[3],
        horizontal_global_attention=True,
    )
    assert torch.equal(bi.make_layout(16), _rows("1110", "1111", "1111", "0111").expand(2, 4, 4))
    with_random = VariableSparsityConfig(
        num_heads=1, block=4, num_random_blocks=2, local_window_blocks=[1], global_block_indices=[]
    )
    random.seed(3)
    first = with_random.make_layout(32)
    random.seed(3)
    assert torch.equal(first, with_random.make_layout(32))
    sums = first[0].sum(-1)
    assert bool(((sums >= 2) & (sums <= 3)).all()) and bool(first[0].diagonal().all())


def test_window_layouts_by_hand() -> None:
    # 5 blocks, a window of 3 centred on each row, block 0 global both ways
    bi = _rows("11111", "11100", "11110", "10111", "10011")
    uni = _rows("10000", "11000", "11100", "10110", "10011")
    assert torch.equal(BSLongformerSparsityConfig(num_heads=1, block=4).make_layout(20)[0], bi)
    longformer_uni = BSLongformerSparsityConfig(num_heads=1, block=4, attention="unidirectional")
    assert torch.equal(longformer_uni.make_layout(20)[0], uni)
    ranges = BSLongformerSparsityConfig(num_heads=1, block=4, global_block_indices=[1], global_block_end_indices=[3])
    assert torch.equal(ranges.make_layout(20)[0], _rows("11100", "11111", "11111", "01111", "01111"))
    no_random = BigBirdSparsityConfig(num_heads=2, block=4, num_random_blocks=0)
    assert torch.equal(no_random.make_layout(20), bi.expand(2, 5, 5))
    bird_uni = BigBirdSparsityConfig(num_heads=1, block=4, num_random_blocks=0, attention="unidirectional")
    assert torch.equal(bird_uni.make_layout(20)[0], uni)
    with_random = BigBirdSparsityConfig(num_heads=1, block=4, num_random_blocks=1, attention="unidirectional")
    random.seed(5)
    layout = with_random.make_layout(32)[0]
    random.seed(5)
    assert torch.equal(layout, with_random.make_layout(32)[0]) and torch.equal(layout, torch.tril(layout))
    random.seed(5)  # the same draws by hand: one block among 0..row for each row, then the window and block 0
    expected = torch.zeros(8, 8, dtype=torch.int64)
    for row in range(8):
        expected[row, random.sample(range(row + 1), 1)] = 1
        expected[row, max(0, row - 1) : row + 2] = 1
    expected[:, 0] = 1
    expected[0, :] = 1
    assert torch.equal(layout, torch.tril(expected))
    with pytest.raises(ValueError, match="use at most 1"):
        BigBirdSparsityConfig(num_heads=1, block=4, num_random_blocks=2, attention="unidirectional").make_layout(32)


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="multiple of num_global_blocks"):
        FixedSparsityConfig(num_heads=1, num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(ValueError, match="different_layout_per_head"):
        FixedSparsityConfig(num_heads=2, num_local_blocks=4, num_different_global_patterns=2)
    with pytest.raises(ValueError, match="multiple of the block size"):
        DenseSparsityConfig(num_heads=1, block=16).make_layout(40)
    with pytest.raises(ValueError, match="one end per start"):
        VariableSparsityConfig(num_heads=1, global_block_indices=[0, 4], global_block_end_indices=[2])


def _dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int
) -> torch.Tensor:
    mask = layout.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2).to(torch.bool)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("attention", ["unidirectional", "bidirectional"])
def test_equals_dense_attention_with_the_layout_mask(attention: str) -> None:
    config = FixedSparsityConfig(
        num_heads=2,
        block=4,
        num_local_blocks=2,
        attention=attention,
        different_layout_per_head=True,
        num_different_global_patterns=2,
    )
    module = SparseSelfAttention(config, max_seq_length=32)
    q, k, v = (torch.randn(2, 2, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = module(q, k, v)
    layout = module.get_layout(24)
    assert torch.equal(layout, config.make_layout(32)[:, :6, :6])
    reference = _dense_reference(q, k, v, layout, 4)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_an_empty_layout_row_gives_zeros_and_float32_matches() -> None:
    layout = torch.tensor([[[1, 0], [0, 0]]])
    q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))
    out = block_sparse_attention(q, k, v, layout, 4, 0.5)
    assert torch.equal(out[:, :, 4:], torch.zeros(1, 1, 4, 4))
    first = torch.softmax((q[:, :, :4] @ k[:, :, :4].transpose(-1, -2)) * 0.5, dim=-1) @ v[:, :, :4]
    torch.testing.assert_close(out[:, :, :4], first, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(8, 4\); it must be \[8, 8\]"):
        SparseSelfAttention(DenseSparsityConfig(num_heads=1, block=4), max_seq_length=8)(q, k, v, attn_mask=q)


def test_memory_follows_the_non_zero_blocks() -> None:
    """Every tensor kept for backward holds at most non-zero blocks x block x max(block, head_dim) elements (the
    scores, the gathered keys and values), far below heads x seq x seq for a sliding-window layout."""
    config = BSLongformerSparsityConfig(num_heads=2, block=4, num_sliding_window_blocks=3)
    layout = config.make_layout(256)  # 64 blocks: rows of 3-4 blocks, plus the global row and column
    q, k, v = (torch.randn(1, 2, 256, 8, requires_grad=True) for _ in range(3))
    sizes: list[int] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        block_sparse_attention(q, k, v, layout, 4, 0.5).sum().backward()
    non_zero = int(layout.sum())
    assert max(sizes) <= non_zero * 4 * 8 < 2 * 256 * 256 // 4  # under a quarter of the dense scores


def test_deepspeed_module_paths_import() -> None:
    from slipstream.ops.sparse_attention.sparse_self_attention import SparseSelfAttention as FromPath
    from slipstream.ops.sparse_attention.sparsity_config import BigBirdSparsityConfig as BirdFromPath
    from slipstream.ops.sparse_attention.sparsity_config import FixedSparsityConfig as FixedFromPath

    assert (FromPath, BirdFromPath, FixedFromPath) == (SparseSelfAttention, BigBirdSparsityConfig, FixedSparsityConfig)
