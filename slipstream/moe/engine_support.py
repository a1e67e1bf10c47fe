"""What the engine asks of a model with MoE layers: expert param groups, their process groups, how expert
parameters are placed, and their names in checkpoints.

[Note: MoE under ZeRO]
- Param groups: every expert parameter must sit in a param group of its own expert group (`"moe": True`,
  `"name": "ep_size_<E>"`); `moe_param_groups` makes them from plain parameters or dense groups, as
  DeepSpeed's `configure_moe_param_groups` does, and re-splits a client optimizer's groups in place.
- Reduction and sharding: the ZeRO optimizer reduces, shards (stages 1-3) and gathers a `"moe"` group over
  its expert-data-parallel group (`group_for`), so expert gradients meet only the ranks holding the same
  experts. The gradient divisor stays the world size times the accumulation steps: an expert's gradient
  already sums the tokens every rank of its expert-parallel group sent it, so averaging over the world
  gives the gradient of the global mean loss, as for dense parameters.
- Placement: dense parameters take rank 0's values; expert parameters take those of the first rank of
  their expert-data-parallel group (ranks of different expert-parallel positions hold different experts).
- Names: local expert i of an MoE layer on expert-parallel rank r is global expert r * L + i; checkpoints
  name expert parameters by global index (`...deepspeed_experts.<global>.<param>`), so a checkpoint saved
  at one ep_size loads at another.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.moe import groups
from slipstream.moe.layer import MoE
from slipstream.moe.utils import is_moe_param, is_moe_param_group, needs_moe_groups
from slipstream.moe.utils import split_params_into_different_moe_groups_for_optimizer as split_groups
from slipstream.zero.optimizer import GroupOver

__all__ = [
    "expert_placement",
    "global_param_names",
    "group_for",
    "has_experts",
    "moe_param_groups",
    "names_held_elsewhere",
    "unit_group",
]

_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def has_experts(model: nn.Module) -> bool:
    return bool(moe_layers(model))


def prepare(model: nn.Module) -> None:
    """Make the expert groups of every MoE layer (collective: all ranks, same order)."""
    for _, layer in moe_layers(model):
        layer.set_deepspeed_parallelism()


def moe_param_groups(params: list[Any]) -> list[Any]:
    """Plain parameters or param groups -> groups where expert parameters sit in their expert groups."""
    if not params:
        return params
    if isinstance(params[0], dict):
        return split_groups(params) if needs_moe_groups(params) else params
    if not any(is_moe_param(p) for p in params):
        return params
    return split_groups({"params": list(params), "name": "dense-params"})


def resplit_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """A client optimizer built over plain parameters: give its expert parameters groups of their own."""
    if needs_moe_groups(optimizer.param_groups):
        optimizer.param_groups[:] = split_groups(list(optimizer.param_groups))


def group_for(hyper: dict[str, Any]) -> GroupOver | None:
    """The process group of a `"moe"` param group: its expert-data-parallel group."""
    if not is_moe_param_group(hyper):
        return None
    return GroupOver(group=groups._get_expert_data_parallel_group(hyper["name"]))


def expert_placement(model: nn.Module) -> dict[int, tuple[int, Any]]:
    """id(expert parameter) -> (source global rank, process group) its initial values come from."""
    out: dict[int, tuple[int, Any]] = {}
    for _, layer in moe_layers(model):
        name = layer.expert_group_name
        source, group = groups._get_expert_broadcast_src_rank(name), groups._get_expert_data_parallel_group(name)
        for param in layer.deepspeed_moe.experts.parameters():
            out[id(param)] = (source, group)
    return out


def unit_group(key: str) -> tuple[Any, int]:
    """ZeRO-3: the process group and source rank of the unit of an MoE layer's experts (group `key`)."""
    return groups._get_expert_data_parallel_group(key), groups._get_expert_broadcast_src_rank(key)


def global_param_names(model: nn.Module, names: dict[int, str]) -> dict[int, str]:
    """`names` (id -> qualified name) with expert parameters renamed to their global expert index."""
    out = dict(names)
    for prefix, layer in moe_layers(model):
        experts = layer.deepspeed_moe.experts.deepspeed_experts
        head = f"{prefix}.{_EXPERTS}" if prefix else _EXPERTS
        for local, expert in enumerate(experts):
            for param_name, param in expert.named_parameters():
                out[id(param)] = f"{head}{layer.global_expert_index(local)}.{param_name}"
    return out


def names_held_elsewhere(model: nn.Module, names: dict[int, str]) -> frozenset[str]:
    """Checkpoint names of the experts other expert-parallel ranks hold (every global index not local here)."""
    out: set[str] = set()
    for prefix, layer in moe_layers(model):
        head = f"{prefix}.{_EXPERTS}" if prefix else _EXPERTS
        local = {layer.global_expert_index(i) for i in range(layer.num_local_experts)}
        first = layer.deepspeed_moe.experts.deepspeed_experts[0]
        for index in range(layer.num_experts):
            if index not in local:
                out.update(f"{head}{index}.{param_name}" for param_name, _ in first.named_parameters())
    return frozenset(out)
