"""`deepspeed.utils.groups`: the process groups client code asks for.

Slipstream trains data-parallel over the whole world: the data-parallel group is the default group and
every model-, tensor- and sequence-parallel size is 1 (rank 0). Expert and pipeline groups come with the
MoE and pipeline features.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_data_parallel_group() -> Any:
    return dist.group.WORLD if _initialized() else None


def get_data_parallel_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def get_data_parallel_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank
get_sequence_parallel_world_size = get_model_parallel_world_size
get_sequence_parallel_rank = get_model_parallel_rank
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
