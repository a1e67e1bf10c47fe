"""SparseSelfAttention's rpe, key padding mask and attention mask (DeepSpeed's semantics: "add" adds the mask,
"mul" masks where it is 0; masks squeezed to [batch, seq] / [seq, seq]) against dense attention with the layout's
mask plus the same terms, values and gradients; their errors; the memory bound with every term given; and
LocalSlidingWindowSparsityConfig's layout against a hand-built one."""

from __future__ import annotations

import pytest
import torch

from slipstream.ops.sparse_attention import (
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
)

BLOCK, HEADS, SEQ, DIM, BATCH = 4, 2, 16, 8, 2


def _additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    return torch.zeros_like(mask).masked_fill(mask == 0, float("-inf")) if mode == "mul" else mask


def _dense(q, k, v, layout, rpe, key_padding, attn, kp_mode, attn_mode):  # type: ignore[no-untyped-def]
    """softmax(q k^T / sqrt(d) + rpe + masks) v with -inf outside the layout, all [batch, heads, seq, seq]."""
    keep = layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2).bool()
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + rpe
    scores = scores + _additive(key_padding, kp_mode)[:, None, None, :] + _additive(attn, attn_mode)[None, None]
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    rpe = torch.randn(BATCH, HEADS, SEQ, SEQ, generator=gen, dtype=torch.float64)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), rpe.requires_grad_()


def _masks(mode: str, kind: str) -> torch.Tensor:
    """A key padding ([batch, seq]) or attention ([seq, seq]) mask in `mode`, keeping the diagonal and column 0."""
    if kind == "key_padding":
        keep = torch.ones(BATCH, SEQ, dtype=torch.bool)
        keep[0, 13:] = keep[1, 5] = False
    else:
        keep = torch.rand(SEQ, SEQ, generator=torch.Generator().manual_seed(7)) > 0.3
        keep |= torch.eye(SEQ, dtype=torch.bool)
        keep[:, 0] = True
    if mode == "mul":
        return keep.double() * 3.0  # any non-zero keeps
    return torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -1e4) + 0.25 * keep.double()


@pytest.mark.parametrize("kp_mode, attn_mode", [("add", "mul"), ("mul", "add")])
def test_rpe_and_masks_equal_dense_attention(kp_mode: str, attn_mode: str) -> None:
    config = VariableSparsityConfig(
        num_heads=HEADS, block=BLOCK, num_random_blocks=1, local_window_blocks=[1, 2], different_layout_per_head=True
    )
    module = SparseSelfAttention(config, key_padding_mask_mode=kp_mode, attn_mask_mode=attn_mode, max_seq_length=32)
    layout = module.get_layout(SEQ)
    q, k, v, rpe = _inputs(0)
    key_padding, attn = _masks(kp_mode, "key_padding"), _masks(attn_mode, "attn")
    reference = _dense(q, k, v, layout, rpe, key_padding, attn, kp_mode, attn_mode)
    grad_out = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, (q, k, v, rpe), grad_out)
    # DeepSpeed's shapes: the key padding mask [batch, 1, 1, seq], the attention mask [1, 1, seq, seq]
    for kp, am in ((key_padding, attn), (key_padding[:, None, None], attn[None, None])):
        out = module(q, k, v, rpe=rpe, key_padding_mask=kp, attn_mask=am)
        torch.testing.assert_close(out, reference, atol=2e-5, rtol=0)
        for got, want in zip(torch.autograd.grad(out, (q, k, v, rpe), grad_out), expected):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_each_term_alone_and_broadcast() -> None:
    config = FixedSparsityConfig(num_heads=HEADS, block=BLOCK, num_local_blocks=2, attention="unidirectional")
    module = SparseSelfAttention(config, max_seq_length=SEQ)
    layout = module.get_layout(SEQ)
    q, k, v, rpe = _inputs(1)
    zero_kp, zero_attn = torch.zeros(BATCH, SEQ, dtype=torch.float64), torch.ones(SEQ, SEQ, dtype=torch.float64)
    shared_rpe = rpe[:1, :1].detach()  # one [seq, seq] table for every batch entry and head
    cases = {
        "rpe": ({"rpe": shared_rpe}, (shared_rpe, zero_kp, zero_attn)),
        "key padding": (
            {"key_padding_mask": _masks("add", "key_padding")},
            (0, _masks("add", "key_padding"), zero_attn),
        ),
        "attn mask": ({"attn_mask": _masks("mul", "attn")}, (0, zero_kp, _masks("mul", "attn"))),
        "key given transposed": ({}, (0, zero_kp, zero_attn)),
    }
    for name, (kwargs, (r, kp, am)) in cases.items():
        key = k.transpose(2, 3) if name == "key given transposed" else k
        out = module(q, key, v, **kwargs)
        torch.testing.assert_close(out, _dense(q, k, v, layout, r, kp, am, "add", "mul"), atol=2e-5, rtol=0, msg=name)


def test_bad_modes_and_shapes_name_the_value_and_the_fix() -> None:
    config = FixedSparsityConfig(num_heads=HEADS, block=BLOCK, num_local_blocks=2)
    with pytest.raises(ValueError, match=r"key_padding_mask_mode='sub' is not a mask mode; use 'add'"):
        SparseSelfAttention(config, key_padding_mask_mode="sub", max_seq_length=SEQ)
    with pytest.raises(ValueError, match=r"attn_mask_mode='multiply' is not a mask mode; use 'add'.* or 'mul'"):
        SparseSelfAttention(config, attn_mask_mode="multiply", max_seq_length=SEQ)
    module = SparseSelfAttention(config, max_seq_length=SEQ)
    q, k, v, rpe = _inputs(2)
    bad = {
        r"key_padding_mask has shape \(2, 3, 16\); it must be \[batch, seq\]": {
            "key_padding_mask": torch.ones(2, 3, 16)
        },
        r"key_padding_mask has shape \(3, 16\); it must be \[2, 16\]": {"key_padding_mask": torch.ones(3, 16)},
        r"attn_mask has shape \(2, 16, 16\); it must be \[seq, seq\]": {"attn_mask": torch.ones(2, 16, 16)},
        r"attn_mask has shape \(16, 8\); it must be \[16, 16\]": {"attn_mask": torch.ones(16, 8)},
        r"rpe has shape \(2, 2, 16\); it must be \[2, 2, 16, 16\] \(the first 2 may be 1\)": {"rpe": rpe[:, :, 0]},
        r"rpe has shape \(3, 2, 16, 16\)": {"rpe": torch.zeros(3, 2, 16, 16, dtype=torch.float64)},
    }
    for message, kwargs in bad.items():
        with pytest.raises(ValueError, match=message):
            module(q, k, v, **kwargs)


def test_memory_follows_the_non_zero_blocks_with_every_term() -> None:
    """With rpe and both masks, every tensor kept for backward still holds at most batch x non-zero blocks x
    block x max(block, head_dim) elements: the dense terms are cut to the layout's blocks before use."""
    seq = 128
    config = LocalSlidingWindowSparsityConfig(num_heads=HEADS, block=BLOCK, num_sliding_window_blocks=3)
    module = SparseSelfAttention(config, max_seq_length=seq)
    q, k, v = (torch.randn(BATCH, HEADS, seq, DIM, requires_grad=True) for _ in range(3))
    rpe = torch.randn(1, HEADS, seq, seq, requires_grad=True)
    sizes: list[int] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = module(q, k, v, rpe=rpe, key_padding_mask=torch.zeros(BATCH, seq), attn_mask=torch.ones(seq, seq))
        out.sum().backward()
    non_zero = int(module.get_layout(seq).sum())
    assert max(sizes) <= BATCH * non_zero * BLOCK * DIM < BATCH * HEADS * seq * seq // 4
    assert rpe.grad is not None and int((rpe.grad != 0).sum()) <= BATCH * non_zero * BLOCK * BLOCK


def _rows(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows], dtype=torch.int64)


def test_local_sliding_window_layout_by_hand() -> None:
    # 6 blocks, a window of 5 (two blocks each side); unidirectional (the default) keeps the row and two before
    causal = LocalSlidingWindowSparsityConfig(2, 4, 5)  # DeepSpeed's positional order: heads, block, window
    expected = _rows("100000", "110000", "111000", "011100", "001110", "000111")
    assert torch.equal(causal.make_layout(24), expected.expand(2, 6, 6))
    both = LocalSlidingWindowSparsityConfig(
        num_heads=1, block=4, num_sliding_window_blocks=3, attention="bidirectional"
    )
    assert torch.equal(both.make_layout(24)[0], _rows("110000", "111000", "011100", "001110", "000111", "000011"))
    with pytest.raises(ValueError, match=r"num_sliding_window_blocks \(7\) exceeds the 6 blocks"):
        LocalSlidingWindowSparsityConfig(num_heads=1, block=4, num_sliding_window_blocks=7).make_layout(24)
    with pytest.raises(NotImplementedError, match="attention='causal'"):
        LocalSlidingWindowSparsityConfig(num_heads=1, attention="causal")
    with pytest.raises(TypeError):
        LocalSlidingWindowSparsityConfig(num_heads=2, different_layout_per_head=True)  # type: ignore[call-arg]


def test_softmax_primitive_takes_rpe_and_half_precision_attention() -> None:
    """DeepSpeed's `Softmax` with `rpe` against the dense softmax of the layout's blocks; bfloat16 attention
    with a mask stays close to the float64 result (its softmax runs in float32)."""
    from slipstream.ops.sparse_attention.softmax import Softmax

    config = FixedSparsityConfig(num_heads=HEADS, block=BLOCK, num_local_blocks=2)
    layout = config.make_layout(SEQ)
    q, k, v, rpe = _inputs(3)
    scores = (q @ k.transpose(-1, -2)).detach()
    keep = layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2).bool()
    dense = torch.softmax((scores * 0.5 + rpe).masked_fill(~keep, float("-inf")), -1)
    blocks = torch.stack(
        [scores[:, h, i * 4 : i * 4 + 4, j * 4 : j * 4 + 4] for h, i, j in layout.nonzero().tolist()], 1
    )
    expected = torch.stack(
        [dense[:, h, i * 4 : i * 4 + 4, j * 4 : j * 4 + 4] for h, i, j in layout.nonzero().tolist()], 1
    )
    torch.testing.assert_close(Softmax(layout, BLOCK)(blocks, scale=0.5, rpe=rpe), expected, atol=2e-5, rtol=0)

    module = SparseSelfAttention(config, max_seq_length=SEQ)
    key_padding = _masks("add", "key_padding")
    want = module(q, k, v, key_padding_mask=key_padding)
    half = module(q.bfloat16(), k.bfloat16(), v.bfloat16(), key_padding_mask=key_padding)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), want, atol=3e-2, rtol=0)


def test_a_loaded_master_layout_replaces_the_one_in_use() -> None:
    """`master_layout` is in the state dict (as in DeepSpeed); loading another module's random layout after a
    forward makes the next forward use it."""
    from slipstream.ops.sparse_attention import BigBirdSparsityConfig

    config = BigBirdSparsityConfig(num_heads=HEADS, block=BLOCK, num_random_blocks=1, num_sliding_window_blocks=1)
    first, second = (SparseSelfAttention(config, max_seq_length=64) for _ in range(2))
    assert not torch.equal(first.master_layout, second.master_layout)
    q, k, v = (torch.randn(1, HEADS, 64, DIM, dtype=torch.float64) for _ in range(3))
    first(q, k, v)
    first.load_state_dict(second.state_dict())
    torch.testing.assert_close(first(q, k, v), second(q, k, v), atol=0, rtol=0)
