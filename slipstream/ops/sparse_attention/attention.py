"""Block-sparse attention as DeepSpeed composes it: the scores of the layout's blocks only (MatMul "sdd" of the
queries and the transposed keys), the block-sparse softmax with the relative position embedding and the masks
(softmax.py), and the probabilities times the values (MatMul "dsd"). Every step gathers the blocks it needs, so
the scores, probabilities and gathered keys and values take batch x non-zero blocks x block x max(block,
head_dim) elements instead of batch x heads x seq x seq. Within a computed block every entry counts; the result
equals dense attention whose mask is the layout expanded to tokens, plus the same rpe and masks. A query block
whose layout row is empty gets zeros. Pure PyTorch, autograd through the gathers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import distributed as dist
from torch import nn

from slipstream.ops.sparse_attention.layouts import SparsityConfig
from slipstream.ops.sparse_attention.matmul import MatMul
from slipstream.ops.sparse_attention.softmax import Softmax, check_mask_mode

__all__ = ["BlockSparseOps", "SparseSelfAttention", "block_sparse_attention"]


@dataclasses.dataclass(frozen=True)
class BlockSparseOps:
    """The three block-sparse steps of one layout: scores, softmax, context."""

    scores: MatMul
    softmax: Softmax
    context: MatMul

    @classmethod
    def of(cls, layout: torch.Tensor, block: int) -> BlockSparseOps:
        layout = layout.cpu()
        return cls(MatMul(layout, block, "sdd", trans_b=True), Softmax(layout, block), MatMul(layout, block, "dsd"))

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        **terms: torch.Tensor | str | None,
    ) -> torch.Tensor:
        """softmax(q k^T * scale + terms) v; `terms` are Softmax's rpe, masks and mask modes."""
        probs = self.softmax(self.scores(query, key), scale, **terms)  # type: ignore[arg-type]
        return self.context(probs, value)


def block_sparse_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: torch.Tensor, block: int, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the layout's blocks only; q, k, v [batch, heads, seq, head_dim], layout
    [heads, seq // block, seq // block]. A query block whose layout row is empty gets zeros."""
    return BlockSparseOps.of(layout, block)(query, key, value, scale)


def _squeezed_mask(name: str, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask in the queries' dtype without its size-1 dimensions, as DeepSpeed takes it: the key padding mask
    keeps its batch dimension ([batch, 1, 1, seq] -> [batch, seq]), the attention mask becomes [seq, seq]."""
    keep = 1 if name == "key_padding_mask" else 0
    squeezed = mask.to(dtype).reshape(mask.shape[:keep] + tuple(s for s in mask.shape[keep:] if s != 1))
    if squeezed.dim() != 2:
        want = "[batch, seq]" if keep else "[seq, seq] (one mask for every batch entry and head, as in DeepSpeed)"
        raise ValueError(
            f"SparseSelfAttention: {name} has shape {tuple(mask.shape)}; it must be {want} once its size-1 "
            "dimensions are dropped"
        )
    return squeezed


class SparseSelfAttention(nn.Module):
    """DeepSpeed's `SparseSelfAttention`: block-sparse scaled dot-product attention of [batch, heads, seq,
    head_dim] tensors with the layout of `sparsity_config`, made once for `max_seq_length` (the `master_layout`
    buffer, broadcast from rank 0 on first use when torch.distributed is initialised) and cut to each
    sequence's blocks. `forward` takes DeepSpeed's `rpe` ([batch, heads, seq, seq], added to the scaled
    scores), `key_padding_mask` ([batch, seq]) and `attn_mask` ([seq, seq]), each mask applied in its mode:
    "add" adds it, "mul" masks where it is 0."""

    master_layout: torch.Tensor

    def __init__(
        self,
        sparsity_config: SparsityConfig | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
    ) -> None:
        super().__init__()
        check_mask_mode("key_padding_mask_mode", key_padding_mask_mode)
        check_mask_mode("attn_mask_mode", attn_mask_mode)
        self.sparsity_config = sparsity_config if sparsity_config is not None else SparsityConfig(num_heads=4)
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.register_buffer("master_layout", self.sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self._ops: dict[int, BlockSparseOps] = {}

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for `seq_len` tokens: the top-left blocks of the master layout."""
        if self._need_layout_synchronization and dist.is_available() and dist.is_initialized():
            dist.broadcast(self.master_layout, src=0)  # random layouts (BigBird, Variable) equal on every rank
            self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if seq_len % block or seq_len > self.max_seq_length:
            raise ValueError(
                f"sequence length {seq_len}: it must be a multiple of the block size {block} and at most "
                f"max_seq_length {self.max_seq_length}; pad the sequence (SparseAttentionUtils.pad_to_block_size) "
                "or raise max_seq_length"
            )
        blocks = seq_len // block
        return self.master_layout[:, :blocks, :blocks].cpu()

    def get_ops(self, seq_len: int) -> BlockSparseOps:
        """The block-sparse steps for `seq_len` tokens, built once per length."""
        if seq_len not in self._ops:
            self._ops[seq_len] = BlockSparseOps.of(self.get_layout(seq_len), self.sparsity_config.block)
        return self._ops[seq_len]

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The key as [batch, heads, seq, head_dim] (a key given transposed is turned back, as in DeepSpeed)."""
        if key.dim() == 4 and key.shape[2] != query.shape[2] and key.shape[3] == query.shape[2]:
            key = key.transpose(2, 3)
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
        return key

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key = self._check_inputs(query, key, value)
        if key_padding_mask is not None:
            key_padding_mask = _squeezed_mask("key_padding_mask", key_padding_mask, query.dtype)
        if attn_mask is not None:
            attn_mask = _squeezed_mask("attn_mask", attn_mask, query.dtype)
        return self.get_ops(query.shape[2])(
            query,
            key,
            value,
            float(query.shape[-1]) ** -0.5,
            rpe=rpe,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            key_padding_mask_mode=self.key_padding_mask_mode,
            attn_mask_mode=self.attn_mask_mode,
        )
