"""`MicsInit`: zero.Init for a MiCS run (DeepSpeed's `deepspeed.runtime.zero.mics.MiCS_Init`).

It takes zero.Init's arguments (DeepSpeed's MiCS_Init takes the same ones) and builds the model as zero.Init does
(zero/init.py), but refuses a config without `zero_optimization.mics_shard_size`, as DeepSpeed's does. While the
model is built its parameters are sharded over the whole data-parallel group, which holds less per rank than a
shard group; the engine (or `module=` here) then shards them into MiCS' shard groups ([Note: MiCS shard groups]
in zero/stage3/sharding.py), one unit at a time.
"""

from __future__ import annotations

from slipstream.config.plan import Stage3Plan
from slipstream.zero.init import Init

__all__ = ["MicsInit"]


class MicsInit(Init):
    """DeepSpeed's `MiCS_Init`: zero.Init whose config must set `zero_optimization.mics_shard_size`."""

    def _check_plan(self, stage3: Stage3Plan) -> None:
        if stage3.shard_size is None:
            raise ValueError(
                "MiCS_Init needs a config with zero_optimization.mics_shard_size > 0 (the ranks per shard group); "
                "pass it as config_dict_or_path, or use zero.Init for plain ZeRO-3"
            )
