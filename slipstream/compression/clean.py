"""redundancy_clean: every compressed layer baked into a plain one, and the units that row, head and channel
pruning masked removed where the group names the layers that read them (`related_modules`).

A group's j-th match of `modules[i]` pairs with the j-th match of each pattern in `related_modules[i]` (a model of
repeated blocks matches one layer per block for each pattern). Without `related_modules` the pruned units stay
in the layer as zeros: its output keeps its size, as in DeepSpeed.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from slipstream.compression.layers import CompressedConv2d, CompressedLinear
from slipstream.compression.plan import GroupPlan, StructuredPlan

__all__ = ["bake_and_shrink", "replace_module"]

Kept = dict[tuple[str, str], torch.Tensor]
"""(module name, pruning method) -> the units that method keeps, as a boolean index."""


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _matching(model: nn.Module, pattern: str) -> list[str]:
    return [name for name, _ in model.named_modules() if name and re.search(pattern, name)]


def _kept_units(model: nn.Module) -> Kept:
    kept: Kept = {}
    for name, module in model.named_modules():
        for method in ("row_pruning", "head_pruning", "channel_pruning"):
            mask = getattr(module, method, None) if isinstance(module, (CompressedLinear, CompressedConv2d)) else None
            if mask is not None and mask.enabled:
                kept[(name, method)] = mask.kept()
    return kept


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone())


def _shrink_outputs(module: nn.Module, method: str, keep: torch.Tensor, heads: int) -> None:
    """Remove the pruned rows / channels of `module`'s output, or the pruned heads of its input (head pruning)."""
    if not isinstance(module, (nn.Linear, nn.Conv2d)):  # baked from a compressed layer: always one of these
        raise TypeError(f"redundancy_clean: a pruned layer became a {type(module).__name__}")
    if method == "head_pruning" and isinstance(module, nn.Linear):
        module.weight = _param(module.weight.view(module.out_features, heads, -1)[:, keep].flatten(1))
        module.in_features = module.weight.shape[1]
        return
    module.weight = _param(module.weight[keep])
    if module.bias is not None:
        module.bias = _param(module.bias[keep])
    if isinstance(module, nn.Linear):
        module.out_features = module.weight.shape[0]
    elif isinstance(module, nn.Conv2d):
        module.out_channels = module.weight.shape[0]


def _shrink_reader(module: nn.Module, name: str, method: str, keep: torch.Tensor, heads: int) -> None:
    """Remove what `module` (a layer related to a pruned one) reads from, or computes for, the pruned units."""
    if method == "head_pruning" and isinstance(module, nn.Linear):  # query / key / value: rows per head
        module.weight = _param(module.weight.view(heads, -1, module.in_features)[keep].flatten(0, 1))
        if module.bias is not None:
            module.bias = _param(module.bias.view(heads, -1)[keep].flatten())
        module.out_features = module.weight.shape[0]
    elif method != "head_pruning" and isinstance(module, nn.Linear):
        module.weight = _param(module.weight[:, keep])
        module.in_features = module.weight.shape[1]
    elif method != "head_pruning" and isinstance(module, nn.Conv2d) and module.groups == 1:
        module.weight = _param(module.weight[:, keep])
        module.in_channels = module.weight.shape[1]
    elif method != "head_pruning" and isinstance(module, nn.BatchNorm2d):
        module.weight, module.bias = _param(module.weight[keep]), _param(module.bias[keep])
        if module.running_mean is not None and module.running_var is not None:
            module.running_mean, module.running_var = module.running_mean[keep], module.running_var[keep]
        module.num_features = int(keep.sum())
    else:
        raise TypeError(
            f"compression_training.{method}: related module {name!r} is a {type(module).__name__}; redundancy_clean "
            "shrinks nn.Linear (and, for rows and channels, ungrouped nn.Conv2d and nn.BatchNorm2d) related modules"
        )


def _shrink_group(model: nn.Module, plan: StructuredPlan, group: GroupPlan, kept: Kept) -> None:
    for i, pattern in enumerate(group.modules):
        pruned = [name for name in _matching(model, pattern) if (name, plan.name) in kept]
        readers = [_matching(model, related) for related in (group.related_modules or ())[i]]
        for related, names in zip((group.related_modules or ())[i], readers):
            if len(names) != len(pruned):
                raise ValueError(
                    f"compression_training.{plan.name}.different_groups.{group.name}: related pattern {related!r} "
                    f"matches {len(names)} modules but {pattern!r} matches {len(pruned)} pruned ones; give patterns "
                    "that match one related layer per pruned layer"
                )
        for j, name in enumerate(pruned):
            keep = kept[(name, plan.name)]
            _shrink_outputs(model.get_submodule(name), plan.name, keep, plan.num_heads)
            for names in readers:
                _shrink_reader(model.get_submodule(names[j]), names[j], plan.name, keep, plan.num_heads)


def bake_and_shrink(model: nn.Module, structured: tuple[StructuredPlan, ...]) -> None:
    """Replace each compressed layer by the plain layer its forward equals now, then remove the pruned units of
    the groups that name related modules (the layers get smaller; the output stays the masked model's)."""
    kept = _kept_units(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, (CompressedLinear, CompressedConv2d)):
            replace_module(model, name, module.cleaned())
    for plan in structured:
        for group in plan.different_groups:
            if group.related_modules is not None:
                _shrink_group(model, plan, group, kept)
