"""A small GPT for the examples and benchmarks: token + position embeddings, pre-LN blocks, causal attention.

Owns the model only (no training loop, no Slipstream import), so the same file also runs under the
DeepSpeed peer of `bench/zero_step.py`. The defaults give about 1.2M parameters (character vocabulary,
4 blocks of width 160), small enough to train visibly in a minute on two CPU cores.

`GPT(config)(idx)` returns logits of shape (batch, time, vocab); `GPT(config)(idx, targets)` returns the
mean cross-entropy loss, which is what `engine(batch)` hands to `engine.backward` in the example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 96
    """Number of token ids (the character vocabulary of the corpus, rounded up)."""
    block_size: int = 128
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 5
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 160
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on attention and MLP outputs (0 keeps runs bit-reproducible)."""
    tie_weights: bool = True
    """Share the token embedding with the output head."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig: {name} must be positive, got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (scaled_dot_product_attention, is_causal=True)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, time, width) -> (batch, heads, time, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, time, vocab), or the mean cross-entropy against `targets` when given."""
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(
                f"sequence of length {time} is longer than GPTConfig.block_size="
                f"{self.config.block_size}; crop the input or raise block_size"
            )
        positions = torch.arange(time, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
