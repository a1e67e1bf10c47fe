"""Models for the ZeRO-3 tests: weight tying with a block reused in a loop, rank-routed MoE, LoRA adapters.

Every model seeds its own construction (never the global RNG), so ranks and the reference agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from tests.harness.models import TinyTransformer


class TiedLoopLM(nn.Module):
    """Embedding tied to the output head, and one block applied twice per forward."""

    def __init__(self, vocab: int = 29, dim: int = 12, seed: int = 0) -> None:
        super().__init__()
        self.vocab = vocab
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))])
            self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens)
        for _ in range(2):
            x = x + self.blocks[0](x)
        return self.head(x)

    def make_batch(self, seed: int, batch_size: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (batch_size, 5), generator=gen)
        return tokens, (tokens * 3 + 1) % self.vocab

    @staticmethod
    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


class MoEBlock(nn.Module):
    """Four experts; only those in `self.active` run (set per rank: rank-dependent control flow)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.active: tuple[int, ...] = (0, 1, 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        return x + sum(torch.tanh(self.experts[e](x)) for e in self.active)


class TinyMoE(nn.Module):
    def __init__(self, dim: int = 10, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(MoEBlock(dim) for _ in range(layers))
            self.out = nn.Linear(dim, 3)

    def route(self, experts: tuple[int, ...]) -> None:
        for layer in self.layers:
            layer.active = experts

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class Experts(nn.Module):
    """Experts as top-level units (a ModuleList under the root): rank-dependent routing breaks this layout."""

    def __init__(self, dim: int = 10, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: Tensor, expert: int) -> Tensor:
        return self.experts[expert](x)


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update B(A(x))."""

    def __init__(self, dim: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class TinyLoRA(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(LoRALinear(dim) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Stack(nn.Module):
    """`count` square Linear layers: the zero.Init memory test's model."""

    def __init__(self, dim: int, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(count))


class CheckpointedTransformer(TinyTransformer):
    """TinyTransformer with activation checkpointing on every block (the forward runs again in backward)."""

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))
