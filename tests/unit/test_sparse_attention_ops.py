"""DeepSpeed's block-sparse primitives (`deepspeed.ops.sparse_attention.matmul.MatMul`, `.softmax.Softmax`):
each mode and transpose against the dense product of the layout-masked matrices, the softmax with its masks
against a dense softmax whose missing blocks are -inf (values and gradients); the op builder says they run here."""

from __future__ import annotations

import pytest
import torch

import slipstream  # noqa: F401  (DeepSpeed's module paths)
from slipstream.ops.sparse_attention.matmul import MatMul
from slipstream.ops.sparse_attention.softmax import Softmax

BLOCK = 4


def _layout(heads: int, rows: int, columns: int, seed: int) -> torch.Tensor:
    """A random block layout of [rows, columns] elements in which every block row and column holds a block."""
    shape = (heads, rows // BLOCK, columns // BLOCK)
    layout = (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.4).long()
    layout[:, :, 0] = 1
    layout[:, 0, :] = 1
    return layout


def _blocks(dense: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """The layout's blocks of [batch, heads, R, C], in layout.nonzero() order, by plain slicing."""
    b = BLOCK
    blocks = [dense[:, h, i * b : (i + 1) * b, j * b : (j + 1) * b] for h, i, j in layout.nonzero().tolist()]
    return torch.stack(blocks, 1)


def _masked(dense: torch.Tensor, layout: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    keep = layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2).bool()
    return dense.masked_fill(~keep[None], fill)


CASES = [(mode, ta, tb) for mode in ("sdd", "dsd", "dds") for ta in (False, True) for tb in (False, True)]


@pytest.mark.parametrize("mode, trans_a, trans_b", CASES)
def test_matmul_equals_the_masked_dense_product(mode: str, trans_a: bool, trans_b: bool) -> None:
    batch, heads, m, n, k = 2, 2, 8, 12, 16
    torch.manual_seed(0)
    a_shape, b_shape = ((k, m) if trans_a else (m, k)), ((n, k) if trans_b else (k, n))
    layout = _layout(heads, *{"sdd": (m, n), "dsd": a_shape, "dds": b_shape}[mode], seed=1)
    a = torch.randn(batch, heads, *a_shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(batch, heads, *b_shape, dtype=torch.float64, requires_grad=True)
    a_dense = _masked(a, layout) if mode == "dsd" else a
    b_dense = _masked(b, layout) if mode == "dds" else b
    expected = (a_dense.transpose(2, 3) if trans_a else a_dense) @ (b_dense.transpose(2, 3) if trans_b else b_dense)
    expected = _blocks(expected, layout) if mode == "sdd" else expected
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (a, b), grad_out)

    a_in = _blocks(a, layout) if mode == "dsd" else a
    b_in = _blocks(b, layout) if mode == "dds" else b
    out = MatMul(layout, BLOCK, mode, trans_a=trans_a, trans_b=trans_b)(a_in, b_in)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out, (a, b), grad_out)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_matmul_half_precision_keeps_its_dtype() -> None:
    layout = _layout(1, 8, 8, seed=2)
    a, b = torch.rand(1, 1, 8, 8, dtype=torch.float16), torch.rand(1, 1, 8, 8, dtype=torch.float16)
    out = MatMul(layout, BLOCK, "sdd")(a, b)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), _blocks(a.float() @ b.float(), layout), rtol=1e-3, atol=1e-3)


def test_softmax_with_masks_equals_the_dense_masked_softmax() -> None:
    batch, heads, n, scale = 2, 2, 16, 0.4
    torch.manual_seed(3)
    layout = _layout(heads, n, n, seed=4)
    x = torch.randn(batch, heads, n, n, dtype=torch.float64, requires_grad=True)
    key_padding = torch.zeros(batch, n, dtype=torch.float64)
    key_padding[0, 5] = key_padding[1, 9] = float("-inf")
    attn = (torch.rand(n, n) > 0.3).double()
    attn[:, 0] = 1  # a kept column in every row
    dense = _masked(x, layout, float("-inf")).masked_fill(attn == 0, float("-inf"))
    expected = _blocks(torch.softmax(dense * scale + key_padding[:, None, None, :], -1), layout)
    grad_out = torch.randn_like(expected)
    (expected_grad,) = torch.autograd.grad(expected, x, grad_out)

    softmax = Softmax(layout, BLOCK)
    out = softmax(_blocks(x, layout), scale=scale, key_padding_mask=key_padding, attn_mask=attn, attn_mask_mode="mul")
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    # "add" mode adds the mask as it is: -inf where "mul" had 0
    additive = torch.zeros(n, n, dtype=torch.float64).masked_fill(attn == 0, float("-inf"))
    again = softmax(_blocks(x, layout), scale=scale, key_padding_mask=key_padding, attn_mask=additive)
    torch.testing.assert_close(again, expected, rtol=1e-12, atol=1e-12)


def test_softmax_errors_name_the_argument() -> None:
    layout = _layout(1, 8, 8, seed=5)
    softmax = Softmax(layout, BLOCK)
    blocks = torch.zeros(1, int(layout.sum()), BLOCK, BLOCK)
    with pytest.raises(ValueError, match=r"rpe has shape \(1, 3, 4, 4\); it must be \[1, 1, 8, 8\]"):
        softmax(blocks, rpe=blocks)
    with pytest.raises(ValueError, match="attn_mask_mode='max' is not a mask mode; use 'add'"):
        softmax(blocks, attn_mask=torch.ones(8, 8), attn_mask_mode="max")
    with pytest.raises(ValueError, match=r"non-zero blocks"):
        softmax(blocks[:, :1])


def test_op_builder_and_deepspeed_paths() -> None:
    import slipstream.ops as ops
    from slipstream.ops.op_builder import SparseAttnBuilder

    assert ops.__compatible_ops__[SparseAttnBuilder.NAME] and SparseAttnBuilder().is_compatible()
    assert hasattr(SparseAttnBuilder().load(), "SparseSelfAttention")
    from slipstream.ops.sparse_attention import matmul, softmax

    assert (matmul.MatMul, softmax.Softmax) == (MatMul, Softmax)
