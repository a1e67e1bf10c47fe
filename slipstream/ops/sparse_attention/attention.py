"""Block-sparse attention computed block by block: for each (head, query block) only the key blocks its layout
row names are gathered (rows grouped by their number of blocks, so nothing is padded), so the scores take
batch x non-zero blocks x block x block elements instead of batch x heads x seq x seq. Within a computed block
every entry counts (as in DeepSpeed's block-sparse softmax); the result equals dense attention whose mask is the
layout expanded to tokens. Pure PyTorch, autograd through the gathers.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.ops.sparse_attention.layouts import SparsityConfig

__all__ = ["SparseSelfAttention", "block_sparse_attention"]


def _row_groups(layout: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The layout's (head, query block) rows grouped by how many key blocks they have: for each count, the
    rows' flat indices (head * blocks + block) and their key-block indices [rows, count]. Empty rows are left out."""
    active = layout.to(torch.bool).flatten(0, 1)
    counts = active.sum(-1)
    groups = []
    for count in torch.unique(counts).tolist():
        if count == 0:
            continue
        rows = torch.nonzero(counts == count).flatten()
        columns = torch.nonzero(active[rows])[:, 1].reshape(len(rows), count)
        groups.append((rows, columns))
    return groups


def block_sparse_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: torch.Tensor, block: int, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the layout's blocks only; q, k, v [batch, heads, seq, head_dim], layout
    [heads, seq // block, seq // block]. A query block whose layout row is empty gets zeros."""
    batch, heads, seq, dim = query.shape
    blocks = seq // block
    queries = query.reshape(batch, heads * blocks, block, dim)
    keys = key.reshape(batch, heads, blocks, block, dim)
    values = value.reshape(batch, heads, blocks, block, dim)
    out = query.new_zeros(batch, heads * blocks, block, dim)
    for rows, columns in _row_groups(layout.to(query.device)):
        row_heads = (rows // blocks)[:, None]
        scores = torch.einsum("bpqd,bpckd->bpqck", queries[:, rows], keys[:, row_heads, columns]) * scale
        probs = torch.softmax(scores.flatten(-2), dim=-1).reshape(scores.shape)
        out = out.index_copy(1, rows, torch.einsum("bpqck,bpckd->bpqd", probs, values[:, row_heads, columns]))
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
