"""DeepSpeed's `BertSparseSelfAttention`: a BERT self-attention layer (query, key and value projections) whose
attention is `SparseSelfAttention`, the layer's attention mask taken as the key padding mask ("add" mode).

`forward(hidden_states, attention_mask)` returns the context [batch, seq, hidden], as DeepSpeed's does. The mask
may be DeepSpeed's extended mask ([batch, 1, 1, seq], 0 to keep and a large negative number to mask) or the
mask Transformers builds for its attention modules: [batch, 1, seq, seq], additive (eager attention) or boolean
with True to keep (SDPA), the same for every query as a padding mask is; a boolean mask becomes 0 / the dtype's
lowest value. `HFBertSparseSelfAttention` is the same layer for a Transformers BERT or RoBERTa model, whose
attention modules return (context, attention weights): it returns (context, None).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from slipstream.ops.sparse_attention.attention import SparseSelfAttention
from slipstream.ops.sparse_attention.layouts import FixedSparsityConfig, SparsityConfig

__all__ = ["BertSparseSelfAttention", "HFBertSparseSelfAttention", "key_padding_from_attention_mask"]


class BertConfigLike(Protocol):
    """What the layer reads of a model config (a Transformers BertConfig / RobertaConfig has both)."""

    hidden_size: int
    num_attention_heads: int


def key_padding_from_attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An attention mask of a BERT layer as the additive key padding mask [batch, seq] in `dtype`."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    if mask.dim() == 4 and mask.shape[2] > 1:  # [batch, 1 or heads, queries, keys]: one row per query
        if not torch.equal(mask, mask[:, :1, :1].expand_as(mask)):
            raise ValueError(
                f"attention_mask of shape {tuple(mask.shape)} differs between queries or heads; sparse self-attention "
                "takes a padding mask (the same for every query) as its key padding mask. For causal attention "
                "use a layout with attention='unidirectional'"
            )
        mask = mask[:, :1, :1]
    return mask.to(dtype)


class BertSparseSelfAttention(nn.Module):
    """BERT self-attention with sparse attention (see the module doc). Unlike Transformers' layer it applies no
    dropout to the attention probabilities, as in DeepSpeed."""

    def __init__(self, config: BertConfigLike, sparsity_config: SparsityConfig | None = None) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
                f"{config.num_attention_heads}; change one of them"
            )
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        layouts = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        self.sparse_self_attention = SparseSelfAttention(layouts)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden] -> [batch, heads, seq, head_size]."""
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cache: object | None = None,
        **unused: object,
    ) -> torch.Tensor:
        """The context [batch, seq, hidden]. Cross-attention and a decoding cache are refused; other keyword
        arguments Transformers passes (position_ids) are not used by self-attention."""
        if encoder_hidden_states is not None or cache is not None:
            raise NotImplementedError(
                "BertSparseSelfAttention is encoder self-attention: cross-attention (encoder_hidden_states) and a "
                "decoding cache are not supported; keep the model's own attention for decoder layers"
            )
        query, key, value = (
            self.transpose_for_scores(proj(hidden_states)) for proj in (self.query, self.key, self.value)
        )
        padding = None if attention_mask is None else key_padding_from_attention_mask(attention_mask, query.dtype)
        context = self.sparse_self_attention(query, key, value, key_padding_mask=padding)
        return context.permute(0, 2, 1, 3).reshape(*hidden_states.shape[:-1], self.all_head_size)


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """The layer for a Transformers model's attention block, which unpacks (context, attention weights)."""

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cache: object | None = None,
        **unused: object,
    ) -> tuple[torch.Tensor, None]:
        return super().forward(hidden_states, attention_mask, encoder_hidden_states, cache), None
