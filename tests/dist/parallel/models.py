"""A tiny Llama-style GPT for the tensor- and sequence-parallel tests: named q/k/v/o and gate/up/down
projections, grouped KV heads, RMS-free LayerNorms, an untied head. With `sp_group` its attention is Ulysses'
`DistributedAttention` and it embeds the global positions it is given."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, SEQ = 64, 32, 4, 2, 8, 8


class Attention(nn.Module):
    def __init__(self, heads: int, kv_heads: int, sp_group: Any) -> None:
        super().__init__()
        self.head_dim = HEAD_DIM
        self.q_proj = nn.Linear(DIM, heads * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, DIM, bias=True)
        self.attend = None
        if sp_group is not None:
            from slipstream.sequence import DistributedAttention

            self.attend = DistributedAttention(None, sp_group, scatter_idx=2, gather_idx=1)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.attend is not None:
            y = self.attend(q, k, v, is_causal=True)
        else:
            qh, kh, vh = (z.transpose(1, 2) for z in (q, k, v))
            kh, vh = (z.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1) for z in (kh, vh))
            y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)
        return self.o_proj(y.reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, heads: int, kv_heads: int, sp_group: Any) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(DIM)
        self.self_attn = Attention(heads, kv_heads, sp_group)
        self.post_attention_layernorm = nn.LayerNorm(DIM)
        self.gate_proj = nn.Linear(DIM, 3 * DIM, bias=False)
        self.up_proj = nn.Linear(DIM, 3 * DIM, bias=True)
        self.down_proj = nn.Linear(3 * DIM, DIM, bias=True)
        self.adapter = nn.Linear(DIM, DIM)  # no rule knows it: reported and left replicated

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + 0.1 * self.adapter(h)


class TinyGPT(nn.Module):
    def __init__(
        self, *, heads: int = HEADS, kv_heads: int = KV_HEADS, layers: int = 2, sp_group: Any = None, seed: int = 0
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed_tokens = nn.Embedding(VOCAB, DIM)
            self.pos_emb = nn.Embedding(4 * SEQ, DIM)
            self.layers = nn.ModuleList(Block(heads, kv_heads, sp_group) for _ in range(layers))
            self.norm = nn.LayerNorm(DIM)
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])
        x = self.embed_tokens(input_ids) + self.pos_emb(position_ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def batches(steps: int, batch: int, seq: int = SEQ) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
