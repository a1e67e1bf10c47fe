"""`deepspeed.utils.groups`: the process groups client code asks for.

Without tensor or sequence parallelism the data-parallel group is the default group and every model-, tensor-
and sequence-parallel size is 1 (rank 0); with them, the groups of the layout built last
(slipstream/parallel/mesh.py). Expert and pipeline groups come with the MoE and pipeline features.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from slipstream.parallel.mesh import current_topology


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_data_parallel_group() -> Any:
    """ZeRO's group: with tensor / sequence parallelism, the data x sequence ranks of this rank's TP shard."""
    topology = current_topology()
    if topology is not None and topology.data_group is not None:
        return topology.data_group
    return dist.group.WORLD if _initialized() else None


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(get_data_parallel_group()) if _initialized() else 1


def get_data_parallel_rank() -> int:
    return dist.get_rank(get_data_parallel_group()) if _initialized() else 0


def get_model_parallel_world_size() -> int:
    topology = current_topology()
    return 1 if topology is None else topology.tp


def get_model_parallel_rank() -> int:
    topology = current_topology()
    return 0 if topology is None else topology.rank % topology.tp


def get_sequence_parallel_world_size() -> int:
    topology = current_topology()
    return 1 if topology is None else topology.sp


def get_sequence_parallel_rank() -> int:
    topology = current_topology()
    return 0 if topology is None or topology.sp_group is None else dist.get_rank(topology.sp_group)


def get_sequence_parallel_group() -> Any:
    topology = current_topology()
    return None if topology is None else topology.sp_group


get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank
_get_sequence_parallel_group = get_sequence_parallel_group
_get_sequence_parallel_world_size = get_sequence_parallel_world_size
_get_sequence_parallel_rank = get_sequence_parallel_rank
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
