"""Ulysses sequence parallelism: `DistributedAttention` (DeepSpeed's `deepspeed.sequence.layer`).

Each rank of a sequence-parallel group holds a slice of the sequence for all heads. Before attention
all-to-alls swap that for the whole sequence and 1/P of the heads; any local attention runs on it; an
all-to-all swaps the output back. A layer issues four all-to-alls forward (q, k, v, output) and four backward
(the backward of an all-to-all is the inverse all-to-all).

[Note: Ulysses memory] A rank should hold its share: q, k and v are swapped one at a time (one send and one
receive buffer of one tensor alive at once; stacking them into one message would triple that), the chunks are
stacked straight into the send buffer from the (possibly non-contiguous) input, and the received buffer is
reshaped without a copy when the gathered dim leads (seq-first layout, or batch 1).

[Note: uneven sequence lengths] The ranks' slices may differ in length (a sequence of 7 on 2 ranks: 4 and 3;
the loader adapter splits like `torch.chunk`). Each forward all-gathers the local lengths (one small
collective), pads every slice to the longest, swaps, and drops the padding rows before the local attention, so
attention sees exactly the real sequence in order: causal masks and softmax are those of the unsharded
sequence. After attention the padding rows are put back (zeros) for the reverse swap and cut off again.
DeepSpeed requires equal slices and computes wrong attention otherwise.

Head counts are read from each call's tensors, so layers with different head counts (or grouped KV heads,
where k and v have fewer heads than q) work; a head count the group size does not divide is an error
naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.comm import collectives

__all__ = ["DistributedAttention", "sdpa_attention", "seq_all_to_all"]


def _swap(x: torch.Tensor, split_dim: int, cat_dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split `x` into P chunks along `split_dim`, send chunk j to rank j, concatenate what arrives along `cat_dim`."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    send = torch.stack(x.chunk(size, dim=split_dim))  # [P, ...]: chunk j goes to rank j
    received = torch.empty_like(send)
    collectives.all_to_all(received, send, group=group)
    del send
    # concatenating the P chunks along cat_dim; a view (no copy) when cat_dim is the leading dim
    return received.movedim(0, cat_dim).flatten(cat_dim, cat_dim + 1)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split_dim: int, cat_dim: int, group: Any) -> torch.Tensor:
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _swap(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        split_dim, cat_dim = ctx.dims
        return _swap(grad, cat_dim, split_dim, ctx.group), None, None, None


def seq_all_to_all(x: torch.Tensor, *, split_dim: int, cat_dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-to-all: `split_dim` is scattered over the group and `cat_dim` gathered."""
    out: torch.Tensor = _SeqAllToAll.apply(x, split_dim, cat_dim, group)
    return out


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    seq_dim: int = 1,
    head_dim: int = 2,
    **kwargs: Any,
) -> torch.Tensor:
    """`scaled_dot_product_attention` on tensors whose sequence and head dims are `seq_dim` / `head_dim` (the
    last dim is the head size); returns the same layout. Extra arguments go to SDPA (`is_causal=True`, ...).
    Grouped KV heads are repeated to the query's head count."""
    order = [d for d in range(query.dim() - 1) if d not in (seq_dim, head_dim)] + [head_dim, seq_dim, query.dim() - 1]
    q, k, v = (t.permute(order) for t in (query, key, value))
    if k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    out = F.scaled_dot_product_attention(q, k, v, *args, **kwargs)
    inverse = [order.index(d) for d in range(query.dim())]
    return out.permute(inverse)


class DistributedAttention(nn.Module):
    """Ulysses attention over `sequence_process_group` (DeepSpeed's signature).

    `local_attention(q, k, v, *args, **kwargs)` sees the whole sequence and this rank's heads, in the input
    layout; None means SDPA (`sdpa_attention`). `scatter_idx` is the head dim and `gather_idx` the sequence dim
    of the inputs: DeepSpeed's defaults (2, 0) are the [seq, batch, heads, head_size] layout; batch-first
    [batch, seq, heads, head_size] is (2, 1). See [Note: uneven sequence lengths] for slices of unequal length.
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor] | nn.Module | None,
        sequence_process_group: dist.ProcessGroup | None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        del sp_stream  # DeepSpeed's overlap stream; the all-to-alls here are not overlapped
        if scatter_idx == gather_idx:
            raise ValueError(f"DistributedAttention: scatter_idx and gather_idx must differ, both are {scatter_idx}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.local_attn is None:
            return sdpa_attention(q, k, v, *args, seq_dim=self.gather_idx, head_dim=self.scatter_idx, **kwargs)
        return self.local_attn(q, k, v, *args, **kwargs)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        group, seq, heads = self.spg, self.gather_idx, self.scatter_idx
        size = dist.get_world_size(group)
        if size == 1:
            return self._attend(query, key, value, *args, **kwargs)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.shape[heads] % size:
                raise ValueError(
                    f"DistributedAttention: {name} has {t.shape[heads]} heads (dim {heads}), which the sequence-"
                    f"parallel size {size} does not divide; use a sequence_parallel_size that divides every "
                    "layer's head count (grouped KV heads included)"
                )
        lengths = self._lengths(query.shape[seq], group, query.device)
        longest = max(lengths)
        # one all-to-all per tensor: the send and receive buffers of one tensor are alive at a time (stacking
        # q, k and v into one message would hold three of each: [Note: Ulysses memory])
        q, k, v = (
            seq_all_to_all(_pad(t, seq, longest), split_dim=heads, cat_dim=seq, group=group)
            for t in (query, key, value)
        )
        real = None
        if any(n != longest for n in lengths):
            real = torch.cat([torch.arange(n, device=q.device) + r * longest for r, n in enumerate(lengths)])
            q, k, v = (t.index_select(seq, real) for t in (q, k, v))
        out = self._attend(q, k, v, *args, **kwargs)
        if real is not None:
            shape = list(out.shape)
            shape[seq] = longest * size
            out = out.new_zeros(shape).index_copy(seq, real, out)
        out = seq_all_to_all(out, split_dim=seq, cat_dim=heads, group=group)
        return out.narrow(seq, 0, query.shape[seq])

    @staticmethod
    def _lengths(local: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
        """Every rank's local sequence length (one small all-gather)."""
        size = dist.get_world_size(group)
        out = torch.zeros(size, dtype=torch.int64, device=device)
        mine = torch.tensor([local], dtype=torch.int64, device=device)
        collectives.all_gather(out, mine, group=group)
        return [int(n) for n in out.tolist()]


def _pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat((x, x.new_zeros(shape)), dim=dim)
