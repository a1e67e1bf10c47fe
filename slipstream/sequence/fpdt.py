"""FPDT (Ulysses-Offload): DeepSpeed's `deepspeed.sequence.fpdt_layer` surface on Slipstream's chunked attention.

- `FPDT_InputConstruct` lays a batch out over the sequence-parallel group chunk by chunk ([Note: FPDT chunks]).
- `FPDT_Attention` projects q, k and v, runs `fpdt_attention` (fpdt_attention.py) with the finished chunks in
  host memory (fpdt_store.py) and projects the output, in Megatron's [seq, batch, hidden] layout.
- `FPDT_FFN` (a GeLU MLP) and `FPDT_LogitsLoss` (the LM head and per-token cross-entropy, all-gathered over the
  group) run chunk by chunk along the sequence and recompute each chunk in backward (tiled.py's machinery).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.comm import collectives
from slipstream.sequence.fpdt_attention import fpdt_attention
from slipstream.sequence.fpdt_store import ChunkStore, DeviceChunks, HostChunks
from slipstream.sequence.tiled import TiledMLP, sequence_tiled_compute

__all__ = ["FPDT_Attention", "FPDT_FFN", "FPDT_InputConstruct", "FPDT_LogitsLoss", "fpdt_token_order"]


class _AttentionConfig(Protocol):
    """The model-config fields FPDT_Attention reads (Megatron's TransformerConfig names)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    kv_channels: int


class _InputArgs(Protocol):
    """The Megatron argument FPDT_InputConstruct reads."""

    ds_sequence_parallel_fpdt_chunk_size: int


def fpdt_token_order(seq_len: int, chunk_size: int, sp_size: int) -> torch.Tensor:
    """The global positions of the group's tokens in rank order (rank 0's local sequence, then rank 1's, ...):
    rank r holds the r-th 1/sp_size of every chunk of `chunk_size` tokens ([Note: FPDT chunks])."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"FPDT: the chunk size must be a positive int, got {chunk_size!r}")
    if seq_len % sp_size or chunk_size % sp_size:
        raise ValueError(
            f"FPDT: the sequence length {seq_len} and chunk size {chunk_size} must both be multiples of the "
            f"sequence-parallel size {sp_size} (each rank holds 1/{sp_size} of every chunk); pad the sequence or "
            "pick a chunk size divisible by the group size"
        )
    pieces: list[list[torch.Tensor]] = [[] for _ in range(sp_size)]
    for start in range(0, seq_len, chunk_size):
        chunk = torch.arange(start, min(start + chunk_size, seq_len))
        for rank, piece in enumerate(chunk.chunk(sp_size)):
            pieces[rank].append(piece)
    return torch.cat([torch.cat(p) for p in pieces])


class FPDT_InputConstruct(nn.Module):
    """DeepSpeed's signature: `tokens`, `labels`, `position_ids` [batch, global seq] (labels, loss_mask and
    position_ids may be None) and `args.ds_sequence_parallel_fpdt_chunk_size`; `generate()` returns this rank's
    tokens, labels and position_ids in FPDT's layout, the loss mask over the whole group in the order
    FPDT_LogitsLoss gathers losses in, and the attention mask unchanged. The chunk size need not divide the
    sequence (the last chunk is shorter); both must be multiples of `sp_size`."""

    def __init__(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        args: _InputArgs,
        sp_size: int,
        sp_rank: int,
    ) -> None:
        super().__init__()
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.global_seq_len, self.batch_size = tokens.shape[1], tokens.shape[0]
        self.local_seq_len = self.global_seq_len // sp_size
        chunk = args.ds_sequence_parallel_fpdt_chunk_size
        self.order = fpdt_token_order(self.global_seq_len, chunk, sp_size).to(tokens.device)
        self.chunk_size = chunk // sp_size  # as DeepSpeed's attribute: a rank's piece of one chunk
        self.num_chunk_per_gpu, self.device = math.ceil(self.global_seq_len / chunk), tokens.device

    def generate(self) -> tuple[torch.Tensor | None, ...]:
        local = self.order[self.sp_rank * self.local_seq_len : (self.sp_rank + 1) * self.local_seq_len]

        def pick(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
            return None if t is None else t[:, index]

        return (
            pick(self.tokens, local),
            pick(self.labels, local),
            pick(self.loss_mask, self.order),
            self.attention_mask,
            pick(self.position_ids, local),
        )


class FPDT_Attention(nn.Module):
    """Causal self-attention over [local seq, batch, hidden] inputs, chunked and offloaded (DeepSpeed's signature).

    `first_weight`/`first_bias` project to q, k and v (concatenated in that order: `num_attention_heads` and
    `num_key_value_heads` heads of `kv_channels`), `second_weight`/`second_bias` project the output.
    `chunk_size` counts the tokens of one attention chunk over the group; the finished chunks wait in host
    memory when `enable_offloading` and the forward's `cpu_offloading` are both true (buffers reused across
    steps). `rotary_pos_emb` is DeepSpeed's (cos, sin) pair over the whole sequence, in sequence order.
    Returns `(output, second_bias)` with `return_bias`, else `(output + second_bias, None)`.
    Not built: attention masks other than causal, attention dropout."""

    def __init__(
        self,
        config: _AttentionConfig,
        first_weight: torch.Tensor,
        first_bias: torch.Tensor | None,
        second_weight: torch.Tensor,
        second_bias: torch.Tensor | None,
        sequence_process_group: dist.ProcessGroup | None,
        gather_idx: int = 0,
        scatter_idx: int = 2,
        return_bias: bool = True,
        chunk_size: int = 65536,
        enable_offloading: bool = True,
    ) -> None:
        super().__init__()
        if (gather_idx, scatter_idx) != (0, 2):
            raise ValueError(
                f"FPDT_Attention: gather_idx={gather_idx}, scatter_idx={scatter_idx}; only the [seq, batch, hidden] "
                "layout (gather_idx=0, scatter_idx=2) is built"
            )
        dropout = getattr(config, "attention_dropout", 0.0)
        if dropout:
            raise NotImplementedError(
                f"FPDT_Attention: config.attention_dropout={dropout} is not built (the chunked "
                "attention has no dropout); set it to 0.0"
            )
        self.spg, self.config, self.chunk_size = sequence_process_group, config, chunk_size
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.kv_channels,
        )
        self.qkv_linear_weight, self.qkv_linear_bias = first_weight, first_bias
        self.qkv_dense_weight, self.qkv_dense_bias = second_weight, second_bias
        self.return_bias, self.enable_offloading = return_bias, enable_offloading
        self.host_store = HostChunks()  # [Note: FPDT chunk store]: buffers reused by every step

    def forward(
        self,
        layernorm_output: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_params: object = None,
        rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        cpu_offloading: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del inference_params  # DeepSpeed ignores it too
        if attention_mask is not None:
            raise NotImplementedError(
                "FPDT_Attention: attention_mask must be None (the attention is causal, as in DeepSpeed)"
            )
        seq, batch = layernorm_output.shape[:2]
        qkv = F.linear(layernorm_output, self.qkv_linear_weight, self.qkv_linear_bias).transpose(0, 1)
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = q.unflatten(-1, (self.heads, self.head_dim))
        k, v = (t.unflatten(-1, (self.kv_heads, self.head_dim)) for t in (k, v))
        if rotary_pos_emb is not None:
            cos, sin = self._local_rotary(rotary_pos_emb, seq)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        store: ChunkStore = self.host_store if self.enable_offloading and cpu_offloading else DeviceChunks()
        out = fpdt_attention(q, k, v, chunk_size=self.chunk_size, group=self.spg, store=store)
        out = torch.matmul(out.transpose(0, 1).reshape(seq, batch, q_width), self.qkv_dense_weight.t())
        if self.return_bias:
            return out, self.qkv_dense_bias
        return (out if self.qkv_dense_bias is None else out + self.qkv_dense_bias), None

    def _local_rotary(self, freqs: tuple[torch.Tensor, torch.Tensor], seq: int) -> tuple[torch.Tensor, ...]:
        """DeepSpeed's (cos, sin), [global seq, 1, 1, rotary dim] in sequence order, at this rank's tokens, as
        [1, local seq, 1, rotary dim]: rotating q and k before the all-to-all equals rotating each chunk after."""
        world = dist.get_world_size(self.spg) if dist.is_initialized() else 1
        rank = dist.get_rank(self.spg) if world > 1 else 0
        positions = fpdt_token_order(seq * world, self.chunk_size, world)[rank * seq : (rank + 1) * seq]
        out = []
        for name, table in zip(("cos", "sin"), freqs):
            if table.shape[0] != seq * world or table[0].numel() != table.shape[-1]:
                raise ValueError(
                    f"FPDT_Attention: rotary_pos_emb {name} has shape {tuple(table.shape)}; expected "
                    f"[{seq * world}, 1, 1, rotary dim] (one row per position of the whole sequence)"
                )
            out.append(table.reshape(table.shape[0], -1)[positions.to(table.device)].unsqueeze(0).unsqueeze(2))
        return tuple(out)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first `cos.shape[-1]` features of [batch, seq, heads, dim] `t` (halves rotated:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)); the other features pass."""
    width = cos.shape[-1]
    rotated, passed = t[..., :width], t[..., width:]
    first, second = rotated.chunk(2, dim=-1)
    turned = torch.cat((-second, first), dim=-1)
    return torch.cat((rotated * cos + turned * sin, passed), dim=-1)


def _gelu_mlp(weights: tuple[torch.Tensor, ...], rows: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = weights
    hidden = F.gelu(F.linear(rows, w1, b1), approximate="tanh")
    return F.linear(hidden, w2, b2)


class FPDT_FFN:
    """`FPDT_FFN.apply(x, w1, b1, w2, b2, add_bias, chunk_size)`: gelu(x w1^T + b1) w2^T (+ b2 with `add_bias`)
    over [seq, batch, hidden] `x`, `chunk_size` sequence positions at a time, recomputed per chunk in backward
    (the chunk size need not divide the sequence). Returns `(output, None)` with `add_bias`, else
    `(output, b2)` for the caller to add (DeepSpeed's convention)."""

    @staticmethod
    def apply(
        x: torch.Tensor,
        w1: torch.Tensor,
        b1: torch.Tensor | None,
        w2: torch.Tensor,
        b2: torch.Tensor | None,
        add_bias: bool,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights = (w1, b1, w2, b2 if add_bias else None)
        chunks = math.ceil(x.shape[0] / chunk_size)
        params = [t for t in weights if t is not None]
        out = TiledMLP.apply(_gelu_mlp, weights, x, chunks, params)
        return out, None if add_bias else b2


class _GatherSequence(torch.autograd.Function):
    """All-gather [local seq, ...] along the sequence over the group; the backward keeps this rank's slice of the
    gradient (every rank computes the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.rank, ctx.length = rank, local.shape[0]
        gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))
        collectives.all_gather(gathered, local.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.narrow(0, ctx.rank * ctx.length, ctx.length), None, None, None


def _token_losses(lm_output: torch.Tensor, labels: torch.Tensor, head: tuple[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of each token of [batch, seq, hidden] `lm_output`: [batch, seq], fp32. The LM head comes in
    a tuple: tiled compute detaches the tensors it passes, and the head's gradient must reach the weight."""
    logits = torch.matmul(lm_output, head[0].t()).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


class FPDT_LogitsLoss:
    """`FPDT_LogitsLoss.apply(lm_output, labels, logit_weights, rank, spg_size, spg, num_chunk)`: the per-token
    cross-entropy of the LM head `logit_weights` over [local seq, batch, hidden] `lm_output` and [batch, local
    seq] `labels`, in `num_chunk` chunks (one chunk's logits alive at a time, recomputed in backward), gathered
    over the sequence-parallel group `spg`: [spg_size * local seq, batch] fp32, in FPDT_InputConstruct's order."""

    @staticmethod
    def apply(
        lm_output: torch.Tensor,
        labels: torch.Tensor,
        logit_weights: torch.Tensor,
        rank: int,
        spg_size: int,
        spg: dist.ProcessGroup | None,
        num_chunk: int,
    ) -> torch.Tensor:
        losses = sequence_tiled_compute(
            _token_losses,
            lm_output.shape[0],
            num_chunk,
            {"lm_output": lm_output.transpose(0, 1), "labels": labels},
            {"head": (logit_weights,)},
            "lm_output",
            compute_params=[logit_weights] if logit_weights.requires_grad else None,
            output_reduction=None,
        ).t()
        if spg_size == 1:
            return losses
        out: torch.Tensor = _GatherSequence.apply(losses, rank, spg_size, spg)
        return out
