"""Chunked causal attention with online softmax, across a Ulysses group: the core of FPDT (Ulysses-Offload).

[Note: FPDT chunks] The sequence is cut into chunks of `chunk_size` tokens (global; the last may be shorter).
With a sequence-parallel group of P ranks each rank holds 1/P of every chunk, in the order FPDT_InputConstruct
lays out (fpdt.py): rank r's local sequence is its piece of chunk 0, then of chunk 1, ... so one all-to-all of
a local chunk (sequence scattered, heads gathered: layer.py's swap) yields that whole chunk, in order, for
1/P of the heads. Attention then runs chunk by chunk:

- forward: for query chunk i, the key/value chunks j <= i are visited in order and folded into a running
  maximum, sum and weighted value sum per query row (online softmax: the previous sum and accumulator are
  rescaled by exp(old max - new max) whenever the maximum grows); the diagonal pair is masked causally. The
  chunk's output is swapped back to the local layout at once. q, k, v, the output and the log-sum-exp of
  each finished chunk go to the chunk store (fpdt_store.py), on the host when offloading.
- backward (recompute per chunk pair, as flash attention's): the output gradient of each chunk is swapped in
  and saved with its row sums D = rowsum(dO * O); then for each key chunk j, for each query chunk i >= j, the
  probabilities are recomputed from the saved log-sum-exp, dV_j and dK_j accumulate and dQ_i accumulates in
  the store. dQ_j is complete once key chunk j is done (no later key chunk reaches it) and dK_j, dV_j at the
  end of their loop: each is swapped back to the local layout as soon as it is complete, and chunk j's saved
  tensors are released then (later key chunks only meet later query chunks). The outputs are released once
  their row sums are taken.

Peak memory: one pair's scores ([heads/P, chunk, chunk]) and O(chunk) of q, k, v, outputs and gradients on the
device, instead of the whole sequence's q, k, v and outputs (and never [sequence, sequence] scores); the price
is one more score computation per pair in the backward. All-to-alls per call: 4 per chunk forward (q, k, v,
output) and 4 per chunk backward (output gradient, dq, dk, dv). Grouped KV heads are handled without
repeating k and v: the g query heads of one KV head are stacked along the rows ([kv heads, g * chunk, dim]).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from slipstream.sequence.fpdt_store import ChunkSession, ChunkStore, DeviceChunks
from slipstream.sequence.layer import _swap

__all__ = ["fpdt_attention", "fpdt_chunk_bounds"]


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call's geometry: [Note: FPDT chunks]."""

    group: dist.ProcessGroup | None
    world: int
    """Ranks in the sequence-parallel group (1: no all-to-alls)."""
    bounds: list[tuple[int, int]]
    """Local (start, end) of each chunk."""
    groups: int
    """Query heads per KV head."""
    scale: float
    acc: torch.dtype
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""


def fpdt_chunk_bounds(local_len: int, chunk_size: int, world_size: int) -> list[tuple[int, int]]:
    """The local (start, end) rows of each chunk: chunk_size // world_size rows each, the last may be shorter."""
    step = chunk_size // world_size
    return [(start, min(start + step, local_len)) for start in range(0, local_len, step)]


def fpdt_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    chunk_size: int,
    group: dist.ProcessGroup | None = None,
    store: ChunkStore | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of [batch, local seq, heads, head_dim] tensors, chunk by chunk ([Note: FPDT chunks]).

    `chunk_size` counts the tokens of one chunk over the whole group (a multiple of the group size); with a
    group of more than one rank the local sequences must be laid out as FPDT_InputConstruct does. `store`
    keeps the finished chunks for the backward (`HostChunks()` to offload them); None keeps them on the
    device. Grouped KV heads (k and v with fewer heads than q) are supported."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    _check(query, key, value, chunk_size, world)
    call = _Call(
        group=group,
        world=world,
        bounds=fpdt_chunk_bounds(query.shape[1], chunk_size, world),
        groups=query.shape[2] // key.shape[2],
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1]),
        acc=torch.promote_types(query.dtype, torch.float32),
    )
    out: torch.Tensor = _ChunkedAttention.apply(query, key, value, call, DeviceChunks() if store is None else store)
    return out


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk_size: int, world: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"FPDT: chunk_size must be a positive int, got {chunk_size!r}")
    if chunk_size % world:
        raise ValueError(
            f"FPDT: chunk_size={chunk_size} is the tokens of one chunk over the {world}-rank sequence-parallel "
            f"group and must be a multiple of {world}; use a chunk_size divisible by the group size"
        )
    if query.dim() != 4 or key.shape != value.shape or key.shape[:2] != query.shape[:2]:
        raise ValueError(
            "FPDT: query, key and value must be [batch, seq, heads, head_dim] with equal batch and seq (and key, "
            f"value equal shapes); got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[2] % key.shape[2] or key.shape[2] % world:
        raise ValueError(
            f"FPDT: {query.shape[2]} query heads and {key.shape[2]} key/value heads: the key/value heads must "
            f"divide the query heads and be divisible by the sequence-parallel size {world}"
        )


def _to_heads(rows: torch.Tensor, call: _Call) -> torch.Tensor:
    """Local rows [b, c, h, d] of one chunk -> the whole chunk for this rank's heads, [b, h/P, C, d]."""
    if call.world > 1:
        rows = _swap(rows, 2, 1, call.group)
    return rows.transpose(1, 2).contiguous()


def _to_rows(heads: torch.Tensor, call: _Call) -> torch.Tensor:
    """The inverse of `_to_heads`: [b, h/P, C, d] -> [b, c, h, d]."""
    rows = heads.transpose(1, 2)
    return _swap(rows, 1, 2, call.group) if call.world > 1 else rows


def _stack_groups(q: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hq, C, d] -> [b, hq / groups, groups * C, d]: the query heads of one KV head as rows."""
    b, hq, c, d = q.shape
    return q.reshape(b, hq // groups, groups * c, d)


def _unstack_groups(q: torch.Tensor, groups: int) -> torch.Tensor:
    b, hk, gc, d = q.shape
    return q.reshape(b, hk * groups, gc // groups, d)


def _scores(q: torch.Tensor, k: torch.Tensor, call: _Call, diagonal: bool) -> torch.Tensor:
    """Scaled scores [b, hk, g * Cq, Ck] of one chunk pair (`call.acc`); the diagonal pair masked causally."""
    scores = torch.matmul(q.to(call.acc), k.to(call.acc).transpose(-1, -2)).mul_(call.scale)
    if diagonal:
        rows, cols = scores.shape[-2], scores.shape[-1]
        position = torch.arange(rows, device=scores.device) % cols
        future = torch.arange(cols, device=scores.device).unsqueeze(0) > position.unsqueeze(1)
        scores.masked_fill_(future, float("-inf"))
    return scores


class _OnlineSoftmax:
    """Running max, sum and weighted value sum of one query chunk over the key chunks seen so far."""

    def __init__(self, q: torch.Tensor, head_dim: int, dtype: torch.dtype) -> None:
        shape = q.shape[:-1]
        self.max = torch.full(shape, float("-inf"), dtype=dtype, device=q.device)
        self.sum = torch.zeros(shape, dtype=dtype, device=q.device)
        self.acc = torch.zeros((*shape, head_dim), dtype=dtype, device=q.device)

    def fold(self, scores: torch.Tensor, v: torch.Tensor) -> None:
        new_max = torch.maximum(self.max, scores.amax(-1))
        rescale = torch.exp(self.max - new_max)  # what the old sum and accumulator were weighted by, relative
        probs = torch.exp(scores - new_max.unsqueeze(-1))
        self.sum = self.sum * rescale + probs.sum(-1)
        self.acc = self.acc * rescale.unsqueeze(-1) + torch.matmul(probs, v.to(probs.dtype))
        self.max = new_max

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised output and the log-sum-exp of each row."""
        return self.acc / self.sum.unsqueeze(-1), self.max + torch.log(self.sum)


class _ChunkedAttention(torch.autograd.Function):
    """[Note: FPDT chunks]; saves into the chunk session, not the autograd context."""

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: _Call, store: ChunkStore
    ) -> torch.Tensor:
        session = store.session()
        out = query.new_empty(query.shape)
        # without a backward to come only k and v are kept (later query chunks read them); q, the output and
        # the log-sum-exp serve the backward alone. The context, and with it the session, dies with the call
        # then, giving the host buffers back (fpdt_store.py)
        backward_due = any(ctx.needs_input_grad[:3])
        for i, (start, end) in enumerate(call.bounds):
            q = _stack_groups(_to_heads(query[:, start:end], call), call.groups)
            k, v = (_to_heads(t[:, start:end], call) for t in (key, value))
            running = _OnlineSoftmax(q, v.shape[-1], call.acc)
            for j in range(i):
                running.fold(_scores(q, session.get("k", j), call, False), session.get("v", j))
            running.fold(_scores(q, k, call, True), v)
            attended, lse = running.result()
            attended = attended.to(query.dtype)
            saved = {"q": q, "k": k, "v": v, "o": attended, "lse": lse} if backward_due else {"k": k, "v": v}
            for kind, t in saved.items():
                session.put(kind, i, t)
            out[:, start:end] = _to_rows(_unstack_groups(attended, call.groups), call)
            del q, k, v, attended, lse, running, saved
        ctx.call, ctx.session = call, session
        ctx.shapes = (query.shape, key.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        session: ChunkSession = ctx.session
        q_shape, kv_shape = ctx.shapes
        for i, (start, end) in enumerate(call.bounds):  # output gradients in, with their row sums
            d_out = _stack_groups(_to_heads(grad[:, start:end], call), call.groups)
            session.put("delta", i, (d_out.to(call.acc) * session.get("o", i).to(call.acc)).sum(-1))
            session.put("do", i, d_out)
            session.drop(i, "o")
        grads = [grad.new_empty(shape) for shape in (q_shape, kv_shape, kv_shape)]
        for j, (start, end) in enumerate(call.bounds):
            d_k, d_v = _key_chunk_backward(session, call, j)
            d_q = _unstack_groups(session.get("dq", j), call.groups)
            for into, chunk_grad in zip(grads, (d_q, d_k, d_v)):
                into[:, start:end] = _to_rows(chunk_grad.to(grad.dtype), call)
            del d_q, d_k, d_v
            session.drop(j, "q", "k", "v", "do", "lse", "delta", "dq")  # later key chunks never meet query chunk j
        session.close()
        return (*grads, None, None)


def _key_chunk_backward(session: ChunkSession, call: _Call, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dK_j and dV_j over query chunks i >= j; adds each pair's dQ_i into the stored accumulators."""
    k, v = session.get("k", j).to(call.acc), session.get("v", j).to(call.acc)
    d_k, d_v = torch.zeros_like(k), torch.zeros_like(v)
    for i in range(j, len(call.bounds)):
        q, d_out = session.get("q", i), session.get("do", i).to(call.acc)
        probs = torch.exp(_scores(q, k, call, i == j) - session.get("lse", i).unsqueeze(-1))
        d_v += torch.matmul(probs.transpose(-1, -2), d_out)
        d_scores = probs * (torch.matmul(d_out, v.transpose(-1, -2)) - session.get("delta", i).unsqueeze(-1))
        del probs, d_out
        d_scores.mul_(call.scale)
        d_q = torch.matmul(d_scores, k)
        if j > 0:
            d_q += session.get("dq", i)
        session.put("dq", i, d_q)
        d_k += torch.matmul(d_scores.transpose(-1, -2), q.to(call.acc))
        del d_scores, d_q, q
    return d_k, d_v
