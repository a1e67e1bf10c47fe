"""DeepSpeed's `DeepSpeedDataSampler` constructor over Slipstream's curriculum sampler (data/curriculum_sampler.py):
DeepSpeed's sampler takes the `data_efficiency` section as a dict and the data-parallel group; the group is not
needed here (every rank computes the same global batches, see [Note: clusters] there)."""

from __future__ import annotations

from typing import Any

from slipstream.config.data_plans import sampling_plan_of
from slipstream.data.curriculum_sampler import CurriculumSampler

__all__ = ["DeepSpeedDataSampler"]


class DeepSpeedDataSampler(CurriculumSampler):
    """`DeepSpeedDataSampler(data_efficiency_config, one_epoch_total_samples, micro_batch_size, data_parallel_rank,
    data_parallel_size, data_parallel_group, gradient_accumulation_steps, global_rank, drop_last=True)`."""

    def __init__(
        self,
        data_efficiency_config: dict[str, Any],
        one_epoch_total_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_parallel_group: object,
        gradient_accumulation_steps: int,
        global_rank: int,
        drop_last: bool = True,
    ) -> None:
        del data_parallel_group, global_rank  # no collective: see the module docstring
        super().__init__(
            sampling_plan_of(data_efficiency_config),
            num_samples=one_epoch_total_samples,
            micro_batch_size=micro_batch_size,
            rank=data_parallel_rank,
            world_size=data_parallel_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            drop_last=drop_last,
        )
