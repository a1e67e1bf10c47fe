"""Block-sparse attention computed block by block: for each (head, query block) only the key blocks its layout
row names are gathered (rows grouped by their number of blocks, so nothing is padded), so the scores take
batch x non-zero blocks x block x block elements instead of batch x heads x seq x seq. The relative position
embedding and the masks (softmax.py's ScoreTerms) are cut to the same blocks and added to the scaled scores.
Within a computed block every entry counts (as in DeepSpeed's block-sparse softmax); the result equals dense
attention whose mask is the layout expanded to tokens, plus the same terms. The softmax runs in float32 for
half-precision inputs. A query block whose layout row is empty gets zeros. Pure PyTorch, autograd through the
gathers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import distributed as dist
from torch import nn

from slipstream.ops.sparse_attention.layouts import SparsityConfig
from slipstream.ops.sparse_attention.matmul import LayoutIndex, compute_dtype
from slipstream.ops.sparse_attention.softmax import ScoreTerms, check_mask_mode

__all__ = ["BlockRows", "SparseSelfAttention", "block_sparse_attention"]


@dataclasses.dataclass(frozen=True)
class BlockRows:
    """A layout's (head, query block) rows grouped by how many key blocks they have. For each count: the rows'
    flat indices (head * blocks + block), their key-block indices [rows, count] and those blocks' positions in
    the layout's non-zero order [rows, count] (where ScoreTerms.blocks puts them). Empty rows are left out."""

    index: LayoutIndex
    groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]

    @classmethod
    def of(cls, layout: torch.Tensor) -> BlockRows:
        active = layout.cpu().to(torch.bool).flatten(0, 1)
        counts = active.sum(-1)
        starts = torch.cumsum(counts, 0) - counts  # each row's first block in the non-zero order
        groups = []
        for count in torch.unique(counts).tolist():
            if count == 0:
                continue
            rows = torch.nonzero(counts == count).flatten()
            columns = torch.nonzero(active[rows])[:, 1].reshape(len(rows), count)
            groups.append((rows, columns, starts[rows, None] + torch.arange(count)))
        return cls(LayoutIndex.of(layout.cpu()), tuple(groups))

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, terms: ScoreTerms
    ) -> torch.Tensor:
        """softmax(q k^T * scale + terms) v over the layout's blocks; q, k, v [batch, heads, seq, head_dim]."""
        batch, heads, seq, dim = query.shape
        blocks = self.index.rows
        block = seq // blocks
        added = terms.blocks(self.index.on(query.device), block, batch, compute_dtype(query.dtype))
        queries = query.reshape(batch, heads * blocks, block, dim)
        keys, values = (x.reshape(batch, heads, blocks, block, dim) for x in (key, value))
        out = query.new_zeros(batch, heads * blocks, block, dim)
        for rows, columns, ids in self.groups:
            rows, columns, ids = rows.to(query.device), columns.to(query.device), ids.to(query.device)
            row_heads = (rows // blocks)[:, None]
            scores = torch.einsum("bpqd,bpckd->bpqck", queries[:, rows], keys[:, row_heads, columns])
            scores = scores.to(compute_dtype(query.dtype)) * scale
            if added is not None:  # [batch, nnz, q, k] -> the group's [batch, rows, q, count, k]
                scores = scores + added[:, ids].permute(0, 1, 3, 2, 4)
            probs = torch.softmax(scores.flatten(-2), dim=-1).reshape(scores.shape).to(value.dtype)
            out = out.index_copy(1, rows, torch.einsum("bpqck,bpckd->bpqd", probs, values[:, row_heads, columns]))
        return out.reshape(batch, heads, seq, dim)


def block_sparse_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: torch.Tensor, block: int, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the layout's blocks only; q, k, v [batch, heads, seq, head_dim], layout
    [heads, seq // block, seq // block]. A query block whose layout row is empty gets zeros."""
    return BlockRows.of(layout).attend(query, key, value, scale, ScoreTerms())


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


def _forget_rows(module: nn.Module, incompatible_keys: object) -> None:
    """After load_state_dict: the grouped rows are rebuilt from the loaded layout on the next forward."""
    if isinstance(module, SparseSelfAttention):
        module._rows.clear()


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
        self._rows: dict[int, BlockRows] = {}
        self.register_load_state_dict_post_hook(_forget_rows)  # a loaded master_layout replaces the drawn one

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

    def get_ops(self, seq_len: int) -> BlockRows:
        """The layout's grouped rows for `seq_len` tokens, built once per length."""
        if seq_len not in self._rows:
            self._rows[seq_len] = BlockRows.of(self.get_layout(seq_len))
        return self._rows[seq_len]

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
        terms = ScoreTerms(rpe, key_padding_mask, attn_mask, self.key_padding_mask_mode, self.attn_mask_mode)
        return self.get_ops(query.shape[2]).attend(query, key, value, float(query.shape[-1]) ** -0.5, terms)
