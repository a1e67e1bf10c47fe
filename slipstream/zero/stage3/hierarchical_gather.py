"""MiCS' hierarchical all-gather of a unit (zero_optimization.mics_hierarchical_params_gather).

[Note: hierarchical gather] A MiCS shard group of n = a x b ranks spanning b nodes of a ranks each (comm/nodes.py:
member (m, l) is the l-th rank of node m) gathers a unit's rows -- the rank-major buffer [n, row] of
zero/stage3/unit.py, row (m, l) from member (m, l) -- in two all-gathers instead of one over all n:
    1. across nodes: the members at position l of every node (the outer group) gather their own rows: each rank
       holds rows (0, l), (1, l), ..., (b - 1, l), [b, row]. Each rank sends only its own row across.
    2. inside the node: the node's members gather those [b, row] blocks: [a, b, row], block l' the rows (m, l')
       of every node m. Copied into the buffer's [b, a, row] order it is the plain gather's buffer, bit for bit
       (the same rows, moved, never summed).
Step 1 runs when the gather is launched; step 2 is asynchronous and the copy is done by `wait()`, so the unit's
gather keeps its launch / wait shape (the forward's prefetch overlaps step 2). The two staging buffers come from
the unit's BufferPool and go back to it. As in DeepSpeed, a shard group that lies inside one node is refused:
there is no cross-node step to take apart. Works for any row layout (exact rows with the unit tag, qwZ's int8
rows): it moves rows without reading them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.comm.collectives import TimedWork
from slipstream.comm.nodes import LOCAL_WORLD_SIZE_ENV, ranks_per_node, two_level_groups
from slipstream.zero.stage3.pool import BufferPool

__all__ = ["HierarchicalGather", "HierarchicalGatherWork", "hierarchical_gather"]

KEY = "zero_optimization.mics_hierarchical_params_gather"


class HierarchicalGatherWork:
    """Step 2 in flight: `wait()` completes it and puts the rows in rank-major order."""

    def __init__(
        self, work: TimedWork, blocks: torch.Tensor, across: torch.Tensor, out: torch.Tensor, pool: BufferPool
    ):
        self._work: TimedWork | None = work
        self.blocks, self.across, self.out, self.pool = blocks, across, out, pool

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        work.wait()
        a, b = self.blocks.shape[0], self.blocks.shape[1]
        self.out.view(b, a, -1).copy_(self.blocks.transpose(0, 1))
        self.pool.give(self.blocks.view(-1))
        self.pool.give(self.across)


class HierarchicalGather:
    """The two-step gather over one shard group cut at node boundaries (see [Note: hierarchical gather])."""

    def __init__(
        self, *, size: int, count: int, inner: dist.ProcessGroup, outer: dist.ProcessGroup, pool: BufferPool
    ) -> None:
        self.size, self.count, self.inner, self.outer, self.pool = size, count, inner, outer, pool
        self.node = dist.get_rank(outer)
        """This rank's node among the group's (its position in the outer group)."""

    def launch(self, buffer: torch.Tensor, own: torch.Tensor) -> HierarchicalGatherWork:
        """Gather every member's row (`own` is this rank's, a row of `buffer`) into `buffer`, rank-major."""
        row = own.numel()
        across = self.pool.take(self.count * row, own.dtype)
        mine = across[self.node * row : (self.node + 1) * row]
        mine.copy_(own)
        self._across_nodes(across, mine)
        blocks = self.pool.take(self.size * self.count * row, own.dtype)
        work = self._within_node(blocks, across)
        return HierarchicalGatherWork(work, blocks.view(self.size, self.count, row), across, buffer, self.pool)

    def _across_nodes(self, across: torch.Tensor, mine: torch.Tensor) -> None:
        """Step 1: the rows at this rank's position in every node (`mine`: this rank's row of `across`)."""
        collectives.all_gather(across, mine, group=self.outer)

    def _within_node(self, blocks: torch.Tensor, across: torch.Tensor) -> TimedWork:
        """Step 2 (launched): every node-mate's block of step 1."""
        return collectives.all_gather(blocks, across, group=self.inner, async_op=True)


def hierarchical_gather(group: dist.ProcessGroup | None, pool: BufferPool) -> HierarchicalGather | None:
    """The two-step gather of a MiCS shard group `group` (None: the world), cut at node boundaries (ranks per node
    from LOCAL_WORLD_SIZE). Collective over `group`. Refused when the group lies inside one node; None with one
    rank per node (the plain gather is the cross-node step itself)."""
    members = dist.get_world_size() if group is None else len(dist.get_process_group_ranks(group))
    local = ranks_per_node(dist.get_world_size())
    if members <= local:
        raise ValueError(
            f"{KEY}: the MiCS shard group of {members} ranks lies inside one node ({LOCAL_WORLD_SIZE_ENV}={local} "
            "ranks per node), so there is no cross-node step to take apart (DeepSpeed refuses this too); set it "
            "to false, or set mics_shard_size to a multiple of the ranks per node"
        )
    cut = two_level_groups(group, local, what=f"{KEY}: {LOCAL_WORLD_SIZE_ENV} (ranks per node)")
    if cut.inner is None or cut.outer is None:  # one rank per node
        return None
    return HierarchicalGather(size=cut.size, count=cut.count, inner=cut.inner, outer=cut.outer, pool=pool)
