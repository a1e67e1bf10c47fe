"""Which ranks a ZeRO-3 unit is sharded over: the whole data-parallel group, or (MiCS) a shard group of it.

[Note: MiCS shard groups] With `mics_shard_size` m the data-parallel group of W ranks is cut into W / m blocks of
m consecutive ranks (comm/nodes.py: the inner groups; one node when m is the ranks per node). Each block holds a
whole copy of the model, sharded over its m ranks: parameter gathers stay inside the block, and so do the
optimizer's masters, states and gradient shards, which are the same on every block. A unit's gradients are
reduce-scattered inside the block, then all-reduced across the blocks (the outer groups: the ranks at the same
position in every block), so every block holds the sum over all W ranks. The optimizer's process group is the
block (the global norm sums the block's shards once), and a checkpoint is written by the first block alone, in
the layout of a plain run over m ranks, which loads at any layout.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from slipstream.comm.nodes import two_level_groups

__all__ = ["ShardGroups", "shard_groups"]


@dataclasses.dataclass(frozen=True)
class ShardGroups:
    """This rank's shard group and replica group (see [Note: MiCS shard groups])."""

    shard: dist.ProcessGroup | None
    """The group units are sharded over (None: the whole world, plain stage 3 without a group)."""
    replicas: dist.ProcessGroup | None
    """The ranks holding the same shards as this one in the other blocks; None when there is one block."""
    replica_index: int
    """Which block this rank is in (block 0 writes the checkpoints)."""


def shard_groups(group: dist.ProcessGroup | None, shard_size: int | None) -> ShardGroups:
    """The shard and replica groups of `group` for `shard_size` ranks per block (None: plain stage 3, one block
    over the whole group). Collective: every rank of `group` calls it with the same arguments."""
    if shard_size is None:
        return ShardGroups(shard=group, replicas=None, replica_index=0)
    layout = two_level_groups(group, shard_size, what="zero_optimization.mics_shard_size")
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    block = members.index(dist.get_rank()) // shard_size
    shard = layout.inner if shard_size > 1 else _singleton()
    if layout.count == 1:
        return ShardGroups(shard=group, replicas=None, replica_index=0)
    return ShardGroups(shard=shard, replicas=layout.outer, replica_index=block)


_SINGLETONS: dict[int, dist.ProcessGroup] = {}


def _singleton() -> dist.ProcessGroup:
    """A group of this rank alone (MiCS with one rank per block: every rank holds the whole model), created with
    local synchronisation: no other rank takes part (as comm/nodes.py builds a sub-group's blocks)."""
    rank = dist.get_rank()
    if rank not in _SINGLETONS:
        _SINGLETONS[rank] = dist.new_group([rank], use_local_synchronization=True)
    return _SINGLETONS[rank]
