"""DeepSpeed's block-sparse softmax (`deepspeed.ops.sparse_attention.softmax.Softmax`) in pure PyTorch.

The input is a block-sparse score matrix stored as its layout's non-zero blocks, [batch, nnz, block, block]
(matmul.py). Each row is normalised over the blocks its layout row holds: x * scale, plus the key padding mask
and the attention mask (mode "add": added as they are; mode "mul": a zero entry masks its position, -inf, any
other keeps it), then exp(x - row max) / row sum, with the row maxima and sums gathered across the row's blocks
by index, so nothing of the dense matrix is built. Half-precision blocks are computed in float32.
"""

from __future__ import annotations

import torch

from slipstream.ops.sparse_attention.matmul import LayoutIndex, compute_dtype

__all__ = ["Softmax"]

MASK_MODES = ("add", "mul")


def _additive(mask: torch.Tensor, mode: str, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A mask as the term added to the scores."""
    if mode not in MASK_MODES:
        raise NotImplementedError(f"Softmax {name}_mode {mode!r} is not one of {MASK_MODES}")
    mask = mask.to(dtype)
    if mode == "mul":
        return torch.zeros_like(mask).masked_fill(mask == 0, float("-inf"))
    return mask


class Softmax:
    """`Softmax(layout, block)(x, scale=1.0, key_padding_mask=None, attn_mask=None, key_padding_mask_mode="add",
    attn_mask_mode="add")`: the row softmax of a block-sparse matrix. `key_padding_mask` is [batch, columns],
    `attn_mask` [rows, columns]; relative position embeddings (`rpe`) are not implemented."""

    def __init__(self, layout: torch.Tensor, block: int, bench: bool = False) -> None:
        self.layout, self.block = layout, block
        self.index = LayoutIndex.of(layout)

    def __call__(
        self,
        x: torch.Tensor,
        scale: float = 1.0,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "add",
    ) -> torch.Tensor:
        if rpe is not None:
            raise NotImplementedError("Softmax(rpe=...): relative position embeddings are not implemented; pass None")
        index, block, dtype = self.index.on(x.device), self.block, x.dtype
        if x.dim() != 4 or x.shape[1] != index.head.numel():
            raise ValueError(
                f"Softmax: x has shape {tuple(x.shape)}; it must be the layout's {index.head.numel()} non-zero "
                f"blocks, [batch, {index.head.numel()}, {block}, {block}]"
            )
        scores = x.to(compute_dtype(dtype)) * scale
        if key_padding_mask is not None:
            term = _additive(key_padding_mask, key_padding_mask_mode, "key_padding_mask", scores.dtype)
            batch = term.shape[0]
            scores = scores + term.reshape(batch, -1, block)[:, index.column].unsqueeze(2)
        if attn_mask is not None:
            term = _additive(attn_mask, attn_mask_mode, "attn_mask", scores.dtype)
            rows, columns = term.shape
            tiles = term.reshape(rows // block, block, columns // block, block).permute(0, 2, 1, 3)
            scores = scores + tiles[index.row, index.column]
        return _row_softmax(scores, index).to(dtype)


def _row_softmax(scores: torch.Tensor, index: LayoutIndex) -> torch.Tensor:
    """Softmax of each matrix row over the blocks of its layout row ([batch, nnz, block, block])."""
    batch, _, block, _ = scores.shape
    group = index.head * index.rows + index.row  # the layout row each block belongs to
    groups = index.heads * index.rows
    with torch.no_grad():  # the shift cancels out of the softmax; only its value matters
        block_max = scores.amax(-1)
        row_max = block_max.new_full((batch, groups, block), float("-inf"))
        row_max = row_max.scatter_reduce(1, group[None, :, None].expand_as(block_max), block_max, "amax")
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    exps = torch.exp(scores - row_max[:, group].unsqueeze(-1))
    sums = exps.new_zeros(batch, groups, block).index_add(1, group, exps.sum(-1))
    return exps / sums[:, group].unsqueeze(-1)
