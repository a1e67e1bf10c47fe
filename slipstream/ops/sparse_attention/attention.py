"""Block-sparse attention computed block by block: for each (head, query block) only the key blocks its layout
row names are gathered, so the scores take batch x heads x seq x (widest layout row x block) elements instead of
seq x seq. Within a computed block every entry counts (as in DeepSpeed's block-sparse softmax); the result
equals dense attention whose mask is the layout expanded to tokens. Pure PyTorch, autograd through the gathers.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.ops.sparse_attention.sparsity_config import SparsityConfig

__all__ = ["SparseSelfAttention", "block_sparse_attention"]


def _row_columns(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key-block indices per (head, query block), padded to the widest row; which of them are real)."""
    active = layout.to(torch.bool)
    counts = active.sum(-1)
    width = max(int(counts.max()), 1)
    order = torch.argsort(active.to(torch.int8), dim=-1, descending=True, stable=True)[..., :width]
    valid = torch.arange(width, device=layout.device) < counts.unsqueeze(-1)
    return order, valid


def block_sparse_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: torch.Tensor, block: int, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the layout's blocks only; q, k, v [batch, heads, seq, head_dim], layout
    [heads, seq // block, seq // block]. A query block whose layout row is empty gets zeros."""
    batch, heads, seq, dim = query.shape
    blocks = seq // block
    columns, valid = _row_columns(layout.to(query.device))
    width = columns.shape[-1]
    head_index = torch.arange(heads, device=query.device)[:, None, None]
    keys = key.reshape(batch, heads, blocks, block, dim)[:, head_index, columns]  # [b, h, n, width, block, d]
    values = value.reshape(batch, heads, blocks, block, dim)[:, head_index, columns]
    queries = query.reshape(batch, heads, blocks, block, dim)
    scores = torch.einsum("bhnqd,bhnrkd->bhnqrk", queries, keys) * scale
    scores = scores.masked_fill(~valid[None, :, :, None, :, None], float("-inf"))
    probs = torch.softmax(scores.reshape(batch, heads, blocks, block, width * block), dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0).reshape(scores.shape)  # empty rows: softmax of -inf only
    out = torch.einsum("bhnqrk,bhnrkd->bhnqd", probs, values)
    return out.reshape(batch, heads, seq, dim)


class SparseSelfAttention(nn.Module):
    """DeepSpeed's `SparseSelfAttention`: block-sparse scaled dot-product attention of [batch, heads, seq,
    head_dim] tensors with the layout of `sparsity_config`, made once for `max_seq_length` and cut to each
    sequence's blocks. Relative position embeddings and the padding and attention masks are not implemented
    (passing one raises NotImplementedError)."""

    def __init__(
        self,
        sparsity_config: SparsityConfig | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
    ) -> None:
        super().__init__()
        self.sparsity_config = sparsity_config if sparsity_config is not None else SparsityConfig(num_heads=4)
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.master_layout = self.sparsity_config.make_layout(max_seq_length)

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for `seq_len` tokens: the top-left blocks of the master layout."""
        block = self.sparsity_config.block
        if seq_len % block or seq_len > self.max_seq_length:
            raise ValueError(
                f"sequence length {seq_len}: it must be a multiple of the block size {block} and at most "
                f"max_seq_length {self.max_seq_length}; pad the sequence or raise max_seq_length"
            )
        blocks = seq_len // block
        return self.master_layout[:, :blocks, :blocks]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for name, given in (("rpe", rpe), ("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if given is not None:
                raise NotImplementedError(
                    f"SparseSelfAttention({name}=...) is not implemented in Slipstream; pass None"
                )
        if query.dim() != 4 or key.shape != query.shape or value.shape != query.shape:
            raise ValueError(
                "SparseSelfAttention is self-attention over [batch, heads, seq, head_dim] tensors of one shape; got "
                f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if query.shape[1] != self.sparsity_config.num_heads:
            raise ValueError(
                f"query has {query.shape[1]} heads but the sparsity config has num_heads="
                f"{self.sparsity_config.num_heads}; make them equal"
            )
        layout = self.get_layout(query.shape[2])
        scale = float(query.shape[-1]) ** -0.5
        return block_sparse_attention(query, key, value, layout, self.sparsity_config.block, scale)
