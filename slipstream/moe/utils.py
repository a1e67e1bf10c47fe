"""DeepSpeed's `deepspeed.moe.utils`: telling expert parameters apart and giving them their own param groups.

An expert parameter carries `allreduce = False` and `group_name = "ep_size_<E>"` (experts.py). The ZeRO
optimizer reduces (and shards) each param group over one process group, so expert parameters need groups of
their own, marked `"moe": True` and named by their expert group: `split_params_into_different_moe_groups_for_
optimizer` makes them; the engine calls it when the model has experts and the optimizer's groups do not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    from slipstream.moe.layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict[str, object]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(
    params: Iterable[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shared, expert = split_params_into_shared_and_expert_params(p for p in group if p.grad is not None)
    return [_grad_in_param_dtype(p) for p in shared], [_grad_in_param_dtype(p) for p in expert]


def _grad_in_param_dtype(p: nn.Parameter) -> torch.Tensor:
    assert p.grad is not None  # split_params_grads_into_shared_and_expert_params keeps only params with grads
    return p.grad.to(p.dtype)


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """Move the expert parameters of every group into new groups (same hyperparameters, `"moe": True`,
    `"name"`: the expert group), one per (source group, expert group), cut at `max_group_size` elements.
    The input groups are modified in place (their expert parameters removed), as DeepSpeed does."""
    if isinstance(param_groups, dict):
        groups_in = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups_in = list(param_groups)
    else:
        raise ValueError(
            f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict or a list/tuple "
            f"of dicts, got {type(param_groups).__name__}"
        )
    added: list[dict[str, Any]] = []
    for group in groups_in:
        shared: list[nn.Parameter] = []
        by_name: dict[str, list[nn.Parameter]] = {}
        for param in group["params"]:
            if is_moe_param(param):
                by_name.setdefault(param.group_name, []).append(param)
            else:
                shared.append(param)
        group["params"] = shared
        for name, params in by_name.items():
            for chunk in _cut(params, max_group_size):
                added.append({**group, "name": name, "moe": True, "params": chunk})
    return groups_in + added


def _cut(params: list[nn.Parameter], limit: int | float | None) -> list[list[nn.Parameter]]:
    if limit is None:
        return [params]
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in params:
        if current and size + param.numel() > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        chunks.append(current)
    return chunks


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Plain parameters or groups without expert groups -> groups with them (DeepSpeed's helper)."""
    if not model_parameters:
        return []
    if isinstance(model_parameters[0], dict):
        if any("moe" in g for g in model_parameters):
            return model_parameters
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model_parameters), "name": "dense-params"}
    )


def needs_moe_groups(param_groups: list[dict[str, Any]]) -> bool:
    """Whether some group mixes expert parameters with others or with another expert group."""
    for group in param_groups:
        names = {p.group_name if is_moe_param(p) else None for p in group["params"]}
        if len(names) > 1 or (names and next(iter(names)) is not None and not is_moe_param_group(group)):
            return True
    return False
