"""Sequence parallelism (DeepSpeed's `deepspeed.sequence`): Ulysses `DistributedAttention`, the loader
adapters that give each rank of a sequence-parallel group its slice of the sequence, and DeepSpeed's ALST
pieces: the Transformers attention wrapper (hf.py; its `register_with_transformers` entry point is
`deepspeed.runtime.sequence_parallel.ulysses_sp`, compat/ulysses_sp.py) and tiled compute (tiled.py)."""

from __future__ import annotations

from slipstream.sequence.data import SequenceShardLoader, UlyssesSPDataLoaderAdapter, shard_sequence
from slipstream.sequence.layer import DistributedAttention
from slipstream.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "DistributedAttention",
    "SequenceShardLoader",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
    "shard_sequence",
]
