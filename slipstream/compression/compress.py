"""init_compression, redundancy_clean and compression_scheduler (DeepSpeed's deepspeed.compression API)."""

from __future__ import annotations

import re

from torch import nn

from slipstream.compression.layers import CompressedLinear
from slipstream.compression.plan import CompressionPlan, GroupPlan, resolve_compression
from slipstream.config.load import load_config

__all__ = ["compression_scheduler", "init_compression", "redundancy_clean"]


def _matches(model: nn.Module, group: GroupPlan) -> list[str]:
    names = [
        name
        for name, module in model.named_modules()
        if name and any(re.search(pattern, name) for pattern in group.modules)
    ]
    return [name for name in names if isinstance(model.get_submodule(name), nn.Linear)]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _compressed(model: nn.Module, name: str) -> CompressedLinear:
    module = model.get_submodule(name)
    if isinstance(module, CompressedLinear):
        return module
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"compression_training: module {name!r} is a {type(module).__name__}; only nn.Linear is compressed"
        )
    compressed = CompressedLinear(module)
    _replace(model, name, compressed)
    return compressed


def _apply(model: nn.Module, plan: CompressionPlan) -> None:
    quant, prune = plan.quantization, plan.pruning
    if quant is not None:
        for group in quant.different_groups:
            for name in _matches(model, group):
                _compressed(model, name).enable_quantization(quant, group)
    if prune is not None:
        for group in prune.different_groups:
            for name in _matches(model, group):
                _compressed(model, name).enable_pruning(group)


def init_compression(
    model: nn.Module, deepspeed_config: object, teacher_model: nn.Module | None = None, mpu: object | None = None
) -> nn.Module:
    """Replace the nn.Linear modules the config's groups name with CompressedLinear (same parameters).

    `deepspeed_config` is a dict or a JSON path. Compression starts when compression_scheduler's steps
    reach each method's schedule_offset. `teacher_model` (layer reduction) and `mpu` are not used.
    """
    plan = resolve_compression(load_config(deepspeed_config))
    target = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    _apply(target, plan)
    return model


def redundancy_clean(model: nn.Module, deepspeed_config: object, mpu: object | None = None) -> nn.Module:
    """Bake each CompressedLinear's current weight (quantized, masked) into a plain nn.Linear, in place."""
    target = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    for name, module in list(target.named_modules()):
        if isinstance(module, CompressedLinear):
            _replace(target, name, module.cleaned())
    return model


class compression_scheduler:  # DeepSpeed's class name
    """Turns compression on at each method's schedule_offset and steps the weight bits; call step() once
    per optimizer step, as DeepSpeed's engine does."""

    def __init__(self, model: nn.Module, compression_config: object) -> None:
        self.model = model
        self.plan = resolve_compression(load_config(compression_config))
        self.training_steps = 0

    def _layers(self) -> list[CompressedLinear]:
        return [m for m in self.model.modules() if isinstance(m, CompressedLinear)]

    def step(self, step_zero_check: bool = False) -> None:
        """Count a training step (not when `step_zero_check`), then enable and schedule compression."""
        if not step_zero_check:
            self.training_steps += 1
        quant, prune = self.plan.quantization, self.plan.pruning
        for layer in self._layers():
            if quant is not None and layer.schedule is not None and self.training_steps >= quant.schedule_offset:
                layer.quantization_enabled = True
                if not step_zero_check:
                    layer.schedule.advance(self.training_steps - quant.schedule_offset)
            if prune is not None and layer.sparse_pruning_mask is not None:
                layer.pruning_enabled = self.training_steps >= prune.schedule_offset
