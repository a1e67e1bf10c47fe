"""Block-sparse self-attention in pure PyTorch (DeepSpeed's `deepspeed.ops.sparse_attention`): block layouts
([heads, blocks, blocks] 0/1 tensors), `SparseSelfAttention`, which computes only the layout's blocks, and
`BertSparseSelfAttention` / `SparseAttentionUtils`, which put it into a BERT or RoBERTa model."""

from __future__ import annotations

from slipstream.ops.sparse_attention.attention import SparseSelfAttention, block_sparse_attention
from slipstream.ops.sparse_attention.bert_sparse_self_attention import BertSparseSelfAttention
from slipstream.ops.sparse_attention.layouts import (
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from slipstream.ops.sparse_attention.section import sparsity_config
from slipstream.ops.sparse_attention.sparse_attention_utils import SparseAttentionUtils
from slipstream.ops.sparse_attention.sparsity_window import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    LocalSlidingWindowSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BertSparseSelfAttention",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "sparsity_config",
]
