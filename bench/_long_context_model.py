"""The Llama-style decoder of bench/long_context.py and of the planner's sequence test, and its training step
under each long-context option. Imports torch only (the DeepSpeed peer loads it too, with its own tiled
classes and checkpoint function through `Kit`).

Each layer: RMSNorm, fused q/k/v projection, causal SDPA, output projection, RMSNorm, gated SiLU MLP (fused
gate/up projection). The model ends with a final RMSNorm, an LM head and the cross-entropy over the shifted
tokens. `attention(q, k, v)` (batch, heads, seq, head size) replaces SDPA: Ulysses' all-to-all wraps it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int


@dataclasses.dataclass(frozen=True)
class Kit:
    """What an option runs with: the checkpoint function (None: no checkpointing), the tiled MLP and logits-loss
    classes (None: untiled) and the attention (None: SDPA on this rank's tokens)."""

    checkpoint: Callable[..., torch.Tensor] | None = None
    tiled_mlp: Any = None
    tiled_loss: Any = None
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_up(x).chunk(2, dim=-1)
    return module.down(F.silu(gate) * up)


def _loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class Layer(nn.Module):
    def __init__(self, dims: Dims, kit: Kit) -> None:
        super().__init__()
        width = dims.hidden
        self.heads, self.kit = dims.heads, kit
        self.n1, self.n2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.gate_up = nn.Linear(width, 2 * dims.intermediate, bias=False)
        self.down = nn.Linear(dims.intermediate, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, w = h.shape
        q, k, v = self.qkv(self.n1(h)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = (self.kit.attention or _sdpa)(q, k, v)
        h = h + self.out(attended.transpose(1, 2).reshape(b, s, w))
        normed = self.n2(h)
        if self.kit.tiled_mlp is None:
            return h + _mlp(self, normed)
        shards = max(1, math.ceil(s / w))  # ALST's choice: slices of about `hidden` tokens
        return h + self.kit.tiled_mlp.apply(_mlp, self, normed, shards, [])


class Model(nn.Module):
    def __init__(self, dims: Dims, kit: Kit) -> None:
        super().__init__()
        self.kit = kit
        self.embed = nn.Embedding(dims.vocab, dims.hidden)
        self.layers = nn.ModuleList(Layer(dims, kit) for _ in range(dims.layers))
        self.norm = nn.RMSNorm(dims.hidden)
        self.head = nn.Linear(dims.hidden, dims.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h) if self.kit.checkpoint is None else self.kit.checkpoint(layer, h)
        h = self.norm(h)
        if self.kit.tiled_loss is None:
            return _loss(self.head, h, targets)
        shards = max(1, math.ceil(h.shape[1] / h.shape[2]))
        return self.kit.tiled_loss.apply(_tiled_loss, self.head, h, targets, None, shards, [], "mean")


def _tiled_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _loss(head, x, y)


def batch(
    dims: Dims, seq: int, rank: int = 0, world: int = 1, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of one sequence of `seq` tokens and its next-token targets: the contiguous
    `rank`-th 1/`world`, or the `rank`-th 1/`world` of the global positions `order` (FPDT's layout)."""
    tokens = torch.randint(0, dims.vocab, (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    local = seq // world
    positions = torch.arange(seq) if order is None else order
    mine = positions[rank * local : (rank + 1) * local]
    return tokens[:, mine].contiguous(), tokens[:, mine + 1].contiguous()


def param_bytes(model: nn.Module) -> int:
    """The parameters' bytes (alive before the step; the step's own tensors, gradients included, are counted)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def step_peak(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, counter: Any) -> int:
    """The peak bytes of tensors one training step (forward, backward) creates, counted by `counter` (a
    `LiveTensorBytes`), gradients included. Storages that exist before the step (parameters, activation
    offload's host buffers from an earlier step) are not counted when an op writes into them in place."""
    import gc

    model.zero_grad(set_to_none=True)
    before = {t.untyped_storage().data_ptr() for t in gc.get_objects() if type(t) in (torch.Tensor, nn.Parameter)}
    counter._seen.update(before)
    with counter:
        model(tokens, targets).backward()
    model.zero_grad(set_to_none=True)
    return int(counter.peak)
