"""Mixture of experts with expert parallelism (DeepSpeed's `deepspeed.moe`): docs/moe.md."""

from __future__ import annotations

from slipstream.moe.layer import MoE
from slipstream.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MoE", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
