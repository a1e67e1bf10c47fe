"""Tiny deterministic models for distributed tests: an MLP and a 2-layer causal transformer.

Owns the model definitions, their deterministic batches and their losses. Shapes are odd on
purpose (13, 37, 61, ...) so that flattening and sharding over 2 or 4 ranks needs padding.
Parameters depend only on `seed` (never on the global RNG), so every rank and the single-process
reference build identical models. Submodules are kept in `layers` ModuleLists so per-layer
collective counts (one all-gather per layer in stage 3) are easy to predict.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_TEACHER_SEED = 1234  # fixed "ground truth" weights so MLP targets carry a learnable signal


class TinyMLP(nn.Module):
    """`num_layers` Linear layers (in_dim -> hidden ... -> out_dim) with tanh between; MSE regression."""

    def __init__(self, in_dim: int = 13, hidden: int = 37, out_dim: int = 5, num_layers: int = 3, *,
                 seed: int = 0) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"TinyMLP: num_layers={num_layers} must be >= 1")
        self.in_dim, self.out_dim = in_dim, out_dim
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x

    def make_batch(self, seed: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """Inputs ~ N(0, 1) from `seed`; targets = tanh(inputs @ teacher), the teacher fixed for all seeds."""
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.randn(batch_size, self.in_dim, generator=gen)
        teacher = torch.randn(self.in_dim, self.out_dim, generator=torch.Generator().manual_seed(_TEACHER_SEED))
        return inputs, torch.tanh(inputs @ teacher / math.sqrt(self.in_dim))

    @staticmethod
    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        # fp32 explicitly: what type promotion gives anyway, and torch 2.4's mse_loss backward fails on a
        # bf16 input with an fp32 target ("Found dtype Float but expected BFloat16").
        return F.mse_loss(outputs.float(), targets.float())


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with a fused qkv projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"CausalSelfAttention: dim={dim} must be divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)); x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Decoder-only LM: token + position embeddings, `layers` blocks, final norm, untied head."""

    def __init__(self, vocab: int = 61, dim: int = 24, heads: int = 2, layers: int = 2, seq: int = 8, *,
                 seed: int = 0) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(vocab, dim)
            self.pos_emb = nn.Embedding(seq, dim)
            self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.seq:
            raise ValueError(f"TinyTransformer: sequence length {t} exceeds seq={self.seq}; build with a larger seq")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))

    def make_batch(self, seed: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """Arithmetic token sequences (start, stride from `seed`) mod vocab; targets are inputs shifted by one."""
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, self.vocab, (batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
        tokens = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    @staticmethod
    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
