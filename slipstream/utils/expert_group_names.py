"""DeepSpeed's names for the expert-group functions (`deepspeed.utils.groups`, expert part), listed once.

moe/groups.py defines them and exports them; compat/alias_table.py declares them under DeepSpeed's path. The
list lives here, free of torch, because the alias table is read by `import slipstream`, which imports no torch.
"""

from __future__ import annotations

EXPERT_GROUP_FUNCTIONS: tuple[str, ...] = (
    "_create_expert_and_data_parallel",
    "_get_expert_parallel_ranks",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_parallel_world_size",
    "_get_expert_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_data_parallel_rank",
    "_get_expert_broadcast_src_rank",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
)
