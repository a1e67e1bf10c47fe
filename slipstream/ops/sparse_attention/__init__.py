"""Block-sparse self-attention in pure PyTorch (DeepSpeed's `deepspeed.ops.sparse_attention`): block layouts
([heads, blocks, blocks] 0/1 tensors) and `SparseSelfAttention`, which computes only the layout's blocks."""

from __future__ import annotations

from slipstream.ops.sparse_attention.attention import SparseSelfAttention, block_sparse_attention
from slipstream.ops.sparse_attention.layouts import (
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from slipstream.ops.sparse_attention.section import sparsity_config
from slipstream.ops.sparse_attention.sparsity_window import BigBirdSparsityConfig, BSLongformerSparsityConfig

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "sparsity_config",
]
