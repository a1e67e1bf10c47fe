"""ZeRO++ hpZ: a unit's secondary shard, so that its gathers after the forward's stay inside a block of ranks.

[Note: hpZ secondary shard] With `zero_hpz_partition_size` h, the ZeRO group of W ranks is cut into blocks of h
consecutive ranks (comm/nodes.py; a node when h is the ranks per node). When a unit's gather over all W ranks
(its primary shards) completes, each rank copies its 1/h of the gathered buffer into the unit's secondary shard:
chunk i of the buffer cut into h equal chunks, for the rank at position i of its block. Until the shards change
(the optimizer step, a checkpoint load, GatheredParameters with a modifier), the unit's hook gathers -- the
backward's, activation checkpointing's, the next micro-batch's forward -- are all-gathers of those chunks inside
the block, straight into the buffer's layout (W is a multiple of h, so the chunks tile it). They move the values
the first gather gave, so training is unchanged; the optimizer, gradients and checkpoints keep the primary shards
over all W ranks. The secondary shard is allocated once per unit (full_numel / h elements in the unit's dtype)
and reused. Each row of the block gather carries the unit's tag, as the primary gather's rows do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.comm.collectives import TimedWork
from slipstream.zero.stage3.pool import BufferPool

__all__ = ["SecondaryShard"]


class SecondaryShard:
    """One unit's secondary shard over its block (see [Note: hpZ secondary shard])."""

    def __init__(
        self, *, full_numel: int, dtype: torch.dtype, device: torch.device, block: dist.ProcessGroup, size: int
    ) -> None:
        self.block, self.size = block, size
        self.position = dist.get_rank(block)
        self.numel = full_numel // size
        self.values = torch.empty(self.numel, dtype=dtype, device=device)
        self.filled = False
        """The values are the unit's current ones (a primary gather filled them since the shards last changed)."""

    def keep(self, full: torch.Tensor) -> None:
        """A primary gather completed into `full`: keep this rank's chunk of it."""
        self.values.copy_(full[self.position * self.numel : (self.position + 1) * self.numel])
        self.filled = True

    def start_gather(self, pool: BufferPool, tag: float) -> tuple[TimedWork, torch.Tensor]:
        """Launch the block's all-gather of the chunks (one row per rank: its chunk, then `tag`)."""
        buffer = pool.take(self.size * (self.numel + 1), self.values.dtype)
        own = buffer.view(self.size, self.numel + 1)[self.position]
        own[:-1].copy_(self.values)
        own[-1] = tag
        return collectives.all_gather(buffer, own, group=self.block, async_op=True), buffer

    def unpack(self, buffer: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The chunks of a completed block gather into `full`; returns the rows' tags (for the unit to check)."""
        rows = buffer.view(self.size, self.numel + 1)
        full.view(self.size, self.numel).copy_(rows[:, :-1])
        return rows[:, -1]

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()
