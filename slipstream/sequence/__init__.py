"""Sequence parallelism (DeepSpeed's `deepspeed.sequence`): Ulysses `DistributedAttention` and the loader
adapter that gives each rank of a sequence-parallel group its slice of the sequence."""

from __future__ import annotations

from slipstream.sequence.data import SequenceShardLoader, shard_sequence
from slipstream.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention", "SequenceShardLoader", "shard_sequence"]
