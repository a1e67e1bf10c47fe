"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the mpu that `register_with_transformers` returns
(Megatron-style getters for the sequence-parallel groups), on the job's mesh (slipstream/parallel/mesh.py).

`initialize_sequence_parallel(n)` builds the data x sequence layout with sequence groups of n consecutive
ranks, the one `initialize(config={"sequence_parallel_size": n})` uses, so the attention wrappers and the
engine share the groups. DeepSpeed names the sequence group the "model parallel" group here too (its only
model-parallel dimension); `initialize(mpu=...)` reads this module as sequence parallelism, not TP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.accelerator import get_accelerator
from slipstream.parallel.mesh import Topology, build_topology, current_topology

__all__ = [
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Sequence groups of `sequence_parallel_size` consecutive ranks over the initialised world."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "initialize_sequence_parallel: torch.distributed is not initialised; call deepspeed.init_distributed() "
            "(or torch.distributed.init_process_group) first"
        )
    world = dist.get_world_size()
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size:
        raise RuntimeError(
            f"world size {world} is not a multiple of sequence_parallel_size {sequence_parallel_size}; launch a "
            f"multiple of {sequence_parallel_size} ranks"
        )
    build_topology(tp=1, sp=sequence_parallel_size, device_type=torch.device(get_accelerator().device_name()).type)


def _topology() -> Topology:
    topology = current_topology()
    if topology is None or topology.sp_group is None:
        raise RuntimeError(
            "the sequence parallel group is not initialised: call initialize_sequence_parallel(n) (or "
            "UlyssesSPAttentionHF.register_with_transformers) first"
        )
    return topology


def get_sequence_parallel_group() -> Any:
    return _topology().sp_group


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(get_sequence_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(get_sequence_parallel_group())


def get_sequence_data_parallel_group() -> Any:
    """The ranks gradients are averaged over: data x sequence (the whole world without tensor parallelism)."""
    group = _topology().data_group
    return dist.group.WORLD if group is None else group


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(get_sequence_data_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(get_sequence_data_parallel_group())


get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
