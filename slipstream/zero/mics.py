"""`MicsInit`: zero.Init for a MiCS run (DeepSpeed's `deepspeed.runtime.zero.mics.MiCS_Init`).

It builds the model as zero.Init does (zero/init.py), and refuses a config without `zero_optimization.mics_shard_size`
(DeepSpeed's MiCS_Init needs it too). While the model is built its parameters are sharded over the whole
data-parallel group, which holds less per rank than a shard group; the engine (or `module=` here) then shards
them into MiCS' shard groups ([Note: MiCS shard groups] in zero/stage3/sharding.py), one unit at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from slipstream.zero.init import Init, _config_dict

__all__ = ["MicsInit"]


class MicsInit(Init):
    """DeepSpeed's `MiCS_Init(module=None, data_parallel_group=None, sequence_data_parallel_group=None,
    mem_efficient_linear=True, remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
    enabled=True, dtype=None, mpu=None)`: zero.Init whose config must set `zero_optimization.mics_shard_size`."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        sequence_data_parallel_group: dist.ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: object = None,
        config: object = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: object = None,
    ) -> None:
        if enabled:
            from slipstream.config.resolve import resolve_zero_init

            stage3, _ = resolve_zero_init(
                _config_dict(config_dict_or_path if config_dict_or_path is not None else config)
            )
            if stage3.shard_size is None:
                raise ValueError(
                    "MiCS_Init needs a config with zero_optimization.mics_shard_size > 0 (the ranks per shard group); "
                    "pass it as config_dict_or_path, or use zero.Init for plain ZeRO-3"
                )
        extra = (
            {}
            if sequence_data_parallel_group is None
            else {"sequence_data_parallel_group": sequence_data_parallel_group}
        )
        super().__init__(
            module=module,
            data_parallel_group=data_parallel_group,
            mem_efficient_linear=mem_efficient_linear,
            remote_device=remote_device,
            pin_memory=pin_memory,
            config_dict_or_path=config_dict_or_path,
            config=config,
            enabled=enabled,
            dtype=dtype,
            mpu=mpu,
            **extra,
        )
