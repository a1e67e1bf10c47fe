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

[Note: Ulysses head chunks] With `head_chunks=n` a rank runs swap, local attention and swap back for 1/n of
its heads at a time, writing each chunk's output into one output tensor, and keeps nothing of them for the
backward: the backward swaps each chunk in again, recomputes its attention (restoring the RNG and autocast
state of the forward, so dropout repeats) and swaps its gradients back into one gradient buffer per input.
Only one chunk's head slices, attention output, scores and swap buffers are alive at once, instead of all of a
rank's heads for the whole sequence, and nothing head-sliced lives between forward and backward. The price is
one more attention forward and three more all-to-alls (of the same total size) per step. A chunk is a view of
heads `rank * local + chunk * per_chunk ...` of the input, so the local attention must treat heads
independently (SDPA, flash attention; not per-head biases indexed by position in the call) and extra arguments
must not need gradients.

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
from slipstream.sequence.rng import RngStates

__all__ = ["DistributedAttention", "sdpa_attention", "seq_all_to_all"]


def _swap(x: torch.Tensor, split_dim: int, cat_dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split `x` into P chunks along `split_dim`, send chunk j to rank j, concatenate what arrives along `cat_dim`."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    # [P, ...]: chunk j goes to rank j; contiguous (gloo requires it; torch.stack would follow the chunks'
    # memory format, channels-last for some 5-d gradients)
    send = x.unflatten(split_dim, (size, -1)).movedim(split_dim, 0).contiguous()
    received = torch.empty_like(send)
    collectives.all_to_all(received, send, group=group)
    del send
    # concatenating the P chunks along cat_dim; a view (no copy) when cat_dim is the leading dim
    return received.movedim(0, cat_dim).flatten(cat_dim, cat_dim + 1)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, split_dim: int, cat_dim: int, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
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
    `head_chunks=n` (Slipstream's own) attends 1/n of this rank's heads at a time and recomputes in backward
    instead of keeping the head slices ([Note: Ulysses head chunks]); None is one call on all of them.
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor] | nn.Module | None,
        sequence_process_group: dist.ProcessGroup | None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: object = None,
        *,
        head_chunks: int | None = None,
    ) -> None:
        super().__init__()
        del sp_stream  # DeepSpeed's overlap stream; the all-to-alls here are not overlapped
        if scatter_idx == gather_idx:
            raise ValueError(f"DistributedAttention: scatter_idx and gather_idx must differ, both are {scatter_idx}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        if head_chunks is not None and (
            isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1
        ):
            raise ValueError(f"DistributedAttention: head_chunks must be a positive int or None, got {head_chunks!r}")
        self.head_chunks = head_chunks

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        if self.local_attn is None:
            return sdpa_attention(q, k, v, *args, seq_dim=self.gather_idx, head_dim=self.scatter_idx, **kwargs)
        return self.local_attn(q, k, v, *args, **kwargs)

    @torch.compiler.disable  # eager inside a compiled block (one graph break): its collectives are not traceable
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object, **kwargs: object
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
        lengths = sequence_lengths(query.shape[seq], group, query.device)
        longest = max(lengths)
        if self.head_chunks is not None:
            return self._chunked(query, key, value, lengths, args, kwargs)
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
        # contiguous in the caller's layout: the heads gathered from each rank are strided in it, and the caller
        # reshapes them for its output projection (a copy) while holding this result; copying here frees the
        # receive buffer at once ([Note: Ulysses memory])
        out = seq_all_to_all(out, split_dim=seq, cat_dim=heads, group=group)
        if out.shape[seq] != query.shape[seq]:  # padding rows to cut (a narrow's backward copies: only then)
            out = out.narrow(seq, 0, query.shape[seq])
        return out.contiguous()

    def _chunked(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        lengths: list[int],
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> torch.Tensor:
        chunks, size = self.head_chunks or 1, len(lengths)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if (t.shape[self.scatter_idx] // size) % chunks:
                raise ValueError(
                    f"DistributedAttention: {name} has {t.shape[self.scatter_idx] // size} heads per rank, which "
                    f"head_chunks={chunks} does not divide; pick head_chunks dividing every per-rank head count"
                )
        for name, arg in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
            if isinstance(arg, torch.Tensor) and arg.requires_grad:
                raise NotImplementedError(
                    f"DistributedAttention(head_chunks={chunks}): {name} of the local attention requires grad; "
                    "chunks are recomputed without gradients for extra arguments; use head_chunks=None"
                )
        plan = _Plan(self, lengths, chunks, args, kwargs)
        out: torch.Tensor = _ChunkedAttention.apply(query, key, value, plan)
        return out


def sequence_lengths(local: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
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


class _Plan:
    """How one call is cut into head chunks: [Note: Ulysses head chunks]."""

    def __init__(
        self,
        layer: DistributedAttention,
        lengths: list[int],
        chunks: int,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> None:
        self.layer, self.lengths, self.chunks, self.args, self.kwargs = layer, lengths, chunks, args, kwargs
        self.group, self.seq, self.heads = layer.spg, layer.gather_idx, layer.scatter_idx
        self.size, self.longest = len(lengths), max(lengths)
        self.pool: dict[str, torch.Tensor] = {}  # swap buffers reused by every chunk of one forward / backward
        self.real: torch.Tensor | None = None
        if any(n != self.longest for n in lengths):
            self.real = torch.cat([torch.arange(n) + r * self.longest for r, n in enumerate(lengths)])

    def _buffer(self, name: str, shape: list[int] | torch.Size, like: torch.Tensor) -> torch.Tensor:
        held = self.pool.get(name)
        if held is None or held.shape != shape or held.dtype != like.dtype or held.device != like.device:
            held = self.pool[name] = like.new_empty(shape)
        return held

    def _heads_view(self, t: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk `chunk` of every rank's heads of `t` (local layout), as [P, ..., seq at seq+1, ..., per_chunk
        heads at heads+1, ...]: a view, so copying into it writes `t`."""
        h = self.heads
        per_chunk = t.shape[h] // (self.size * self.chunks)
        return t.unflatten(h, (self.size, self.chunks, per_chunk)).select(h + 1, chunk).movedim(h, 0)

    def swap_in(self, t: torch.Tensor, chunk: int, name: str) -> torch.Tensor:
        """This rank's heads of chunk `chunk`, whole sequence (padding rows dropped), from a local-layout tensor;
        received into the pooled buffer `name` (valid until the next swap into it)."""
        s = self.seq
        view = self._heads_view(t, chunk)
        shape = list(view.shape)
        shape[s + 1] = self.longest
        send = self._buffer("send", shape, view)
        if self.real is not None:
            send.zero_()
        send.narrow(s + 1, 0, view.shape[s + 1]).copy_(view)
        received = self._buffer(name, shape, view)
        collectives.all_to_all(received, send, group=self.group)
        whole = received.movedim(0, s).flatten(s, s + 1)
        if self.real is not None:
            whole = whole.index_select(s, self.real.to(whole.device))
        return whole

    def swap_out(self, t: torch.Tensor, into: torch.Tensor, chunk: int) -> None:
        """Write a head-layout chunk (whole sequence) back into chunk `chunk` of the local-layout `into`."""
        s = self.seq
        if self.real is not None:
            shape = list(t.shape)
            shape[s] = self.longest * self.size
            t = t.new_zeros(shape).index_copy(s, self.real.to(t.device), t)
        view = t.unflatten(s, (self.size, self.longest)).movedim(s, 0)
        send = self._buffer("send", view.shape, view).copy_(view)
        del t, view
        received = self._buffer("back", send.shape, send)
        collectives.all_to_all(received, send, group=self.group)
        self._heads_view(into, chunk).copy_(received.narrow(s + 1, 0, into.shape[s]))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.layer._attend(q, k, v, *self.args, **self.kwargs)


class _ChunkedAttention(torch.autograd.Function):
    """Swap, attention and swap back per head chunk; saves only its inputs and recomputes in backward."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: _Plan) -> torch.Tensor:
        device = query.device
        ctx.plan, ctx.rng = plan, RngStates(device)
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        ctx.save_for_backward(query, key, value)
        out: torch.Tensor | None = None
        for chunk in range(plan.chunks):
            q, k, v = (plan.swap_in(t, chunk, name) for t, name in ((query, "q"), (key, "k"), (value, "v")))
            ctx.rng.record()
            attended = plan.attend(q, k, v)
            del q, k, v
            if out is None:
                shape = list(query.shape)
                shape[-1] = attended.shape[-1]
                out = attended.new_empty(shape)
            plan.swap_out(attended, out, chunk)
            del attended
        plan.pool.clear()
        if out is None:
            raise RuntimeError("DistributedAttention: no head chunk ran (head_chunks < 1)")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        query, key, value = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (query, key, value)]
        device = query.device
        enabled, dtype = ctx.autocast
        for chunk in range(plan.chunks):
            inputs = [
                plan.swap_in(t, chunk, name).detach().requires_grad_()
                for t, name in ((query, "q"), (key, "k"), (value, "v"))
            ]
            with ctx.rng.restored(chunk), torch.enable_grad():
                with torch.autocast(device.type, dtype=dtype, enabled=enabled):
                    attended = plan.attend(*inputs)
            upstream = plan.swap_in(grad, chunk, "grad")
            chunk_grads = torch.autograd.grad(attended, inputs, upstream)
            del attended, upstream, inputs
            for g, into in zip(chunk_grads, grads):
                plan.swap_out(g, into, chunk)
            del chunk_grads
        plan.pool.clear()
        return (*grads, None)
