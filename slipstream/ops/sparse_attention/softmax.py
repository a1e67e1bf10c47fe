"""DeepSpeed's block-sparse softmax (`deepspeed.ops.sparse_attention.softmax.Softmax`) in pure PyTorch.

The input is a block-sparse score matrix stored as its layout's non-zero blocks, [batch, nnz, block, block]
(matmul.py). Each row is normalised over the blocks its layout row holds: x * scale, plus the relative position
embedding `rpe`, the key padding mask and the attention mask (mode "add": added as they are; mode "mul": a zero
entry masks its position, -inf, any other keeps it), then exp(x - row max) / row sum, with the row maxima and
sums gathered across the row's blocks by index. The dense terms are cut to the layout's blocks before anything is
computed on them, so nothing the size of the dense matrix is built. Half-precision blocks are computed in float32.
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.ops.sparse_attention.matmul import LayoutIndex, compute_dtype

__all__ = ["MASK_MODES", "ScoreTerms", "Softmax", "check_mask_mode", "layout_blocks"]

MASK_MODES = ("add", "mul")


def check_mask_mode(name: str, mode: str) -> None:
    """A mask mode is "add" or "mul"."""
    if mode not in MASK_MODES:
        raise ValueError(
            f"{name}={mode!r} is not a mask mode; use 'add' (the mask is added to the scores) or 'mul' (a zero "
            "entry masks its position)"
        )


def _additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Mask entries as the term added to the scores (`mask` already in the scores' dtype)."""
    if mode == "mul":
        return torch.zeros_like(mask).masked_fill(mask == 0, float("-inf"))
    return mask


def layout_blocks(dense: torch.Tensor, index: LayoutIndex, block: int) -> torch.Tensor:
    """The layout's blocks of a dense [batch, heads, rows, columns] term (batch and heads may be 1, broadcast):
    [batch, nnz, block, block], gathered from views, so only the non-zero blocks are copied."""
    batch, heads, rows, columns = dense.shape
    tiles = dense.reshape(batch, heads, rows // block, block, columns // block, block).transpose(3, 4)
    return tiles.expand(batch, index.heads, *tiles.shape[2:])[:, index.head, index.row, index.column]


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], broadcast: int) -> None:
    """`tensor` has the `expected` shape, except that its first `broadcast` sizes may be 1."""
    fits = tensor.dim() == len(expected) and all(
        got == want or (got == 1 and dim < broadcast) for dim, (got, want) in enumerate(zip(tensor.shape, expected))
    )
    if not fits:
        ones = f" (the first {broadcast} may be 1)" if broadcast else ""
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must be {list(expected)}{ones}")


@dataclasses.dataclass(frozen=True)
class ScoreTerms:
    """What is added to the scaled scores: a relative position embedding [batch, heads, rows, columns] (batch and
    heads may be 1), a key padding mask [batch, columns] (batch may be 1) and an attention mask [rows, columns],
    each mask in its mode ("add" or "mul")."""

    rpe: torch.Tensor | None = None
    key_padding_mask: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    key_padding_mask_mode: str = "add"
    attn_mask_mode: str = "add"

    def __post_init__(self) -> None:
        check_mask_mode("key_padding_mask_mode", self.key_padding_mask_mode)
        check_mask_mode("attn_mask_mode", self.attn_mask_mode)

    def blocks(self, index: LayoutIndex, block: int, batch: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Their sum over the layout's blocks, [batch or 1, nnz, block, block] in `dtype` (None without terms);
        each dense term is cut to the blocks first."""
        rows, columns = index.rows * block, index.columns * block
        total: torch.Tensor | None = None
        if self.rpe is not None:
            _check_shape("rpe", self.rpe, (batch, index.heads, rows, columns), 2)
            total = layout_blocks(self.rpe.to(dtype), index, block)
        if self.key_padding_mask is not None:
            _check_shape("key_padding_mask", self.key_padding_mask, (batch, columns), 1)
            mask = self.key_padding_mask.to(dtype).reshape(-1, index.columns, block)[:, index.column]
            term = _additive(mask, self.key_padding_mask_mode).unsqueeze(2)
            total = term if total is None else total + term
        if self.attn_mask is not None:
            _check_shape("attn_mask", self.attn_mask, (rows, columns), 0)
            term = _additive(layout_blocks(self.attn_mask.to(dtype)[None, None], index, block), self.attn_mask_mode)
            total = term if total is None else total + term
        return total


class Softmax:
    """`Softmax(layout, block)(x, scale=1.0, rpe=None, key_padding_mask=None, attn_mask=None,
    key_padding_mask_mode="add", attn_mask_mode="add")`: the row softmax of a block-sparse matrix, with the
    terms of `ScoreTerms` added to the scaled scores."""

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
        terms = ScoreTerms(rpe, key_padding_mask, attn_mask, key_padding_mask_mode, attn_mask_mode)
        index, block, dtype = self.index.on(x.device), self.block, x.dtype
        if x.dim() != 4 or x.shape[1] != index.head.numel():
            raise ValueError(
                f"Softmax: x has shape {tuple(x.shape)}; it must be the layout's {index.head.numel()} non-zero "
                f"blocks, [batch, {index.head.numel()}, {block}, {block}]"
            )
        scores = x.to(compute_dtype(dtype)) * scale
        added = terms.blocks(index, block, x.shape[0], scores.dtype)
        scores = scores if added is None else scores + added
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
