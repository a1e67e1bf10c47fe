"""init_compression, redundancy_clean and compression_scheduler (DeepSpeed's deepspeed.compression API)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from torch import nn

from slipstream.compression.activation import InputQuantizer
from slipstream.compression.clean import bake_and_shrink, replace_module
from slipstream.compression.layer_reduction import initialize_student
from slipstream.compression.layers import CompressedConv2d, CompressedLinear, enable_activation_quantization
from slipstream.compression.plan import CompressionPlan, GroupPlan, resolve_compression
from slipstream.config.load import load_config

__all__ = ["compression_scheduler", "init_compression", "redundancy_clean"]

Compressed = CompressedLinear | CompressedConv2d


def _targets(
    model: nn.Module,
    groups: Sequence[GroupPlan],
    kind: type[nn.Module] | tuple[type[nn.Module], ...] = nn.Linear,
) -> Iterator[tuple[GroupPlan, str]]:
    """(group, layer name) for each layer of type `kind` that a group's `modules` patterns name."""
    for group in groups:
        names = [
            name
            for name, module in model.named_modules()
            if name and any(re.search(pattern, name) for pattern in group.modules) and isinstance(module, kind)
        ]  # listed before the caller replaces any of them
        yield from ((group, name) for name in names)


def _compressed(model: nn.Module, name: str) -> Compressed:
    module = model.get_submodule(name)
    if isinstance(module, (CompressedLinear, CompressedConv2d)):
        return module
    if isinstance(module, nn.Conv2d):
        compressed: Compressed = CompressedConv2d(module)
    elif isinstance(module, nn.Linear):
        compressed = CompressedLinear(module)
    else:
        raise TypeError(
            f"compression_training: module {name!r} is a {type(module).__name__}; only nn.Linear (and nn.Conv2d "
            "for channel pruning) is compressed"
        )
    replace_module(model, name, compressed)
    return compressed


def _linear(model: nn.Module, name: str) -> CompressedLinear:
    layer = _compressed(model, name)
    assert isinstance(layer, CompressedLinear)  # _targets matched an nn.Linear
    return layer


def _apply(model: nn.Module, plan: CompressionPlan) -> None:
    quant, prune, activation = plan.quantization, plan.pruning, plan.activation
    if quant is not None:
        for group, name in _targets(model, quant.different_groups):
            _linear(model, name).enable_quantization(quant, group)
    if prune is not None:
        for group, name in _targets(model, prune.different_groups):
            _linear(model, name).enable_pruning(prune, group)
    if activation is not None:
        for group, name in _targets(model, activation.different_groups, (nn.Linear, nn.Conv2d)):
            enable_activation_quantization(_compressed(model, name), activation, group)
    for structured in plan.structured:
        kind = nn.Conv2d if structured.name == "channel_pruning" else nn.Linear
        for group, name in _targets(model, structured.different_groups, kind):
            _compressed(model, name).enable_structured(structured, group, name)


def _target(model: nn.Module) -> nn.Module:
    """The user's model (inside an engine or a wrapper that keeps it as `.module`)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def init_compression(
    model: nn.Module, deepspeed_config: object, teacher_model: nn.Module | None = None, mpu: object | None = None
) -> nn.Module:
    """Replace the layers the config's groups name with CompressedLinear / CompressedConv2d (same parameters).

    `deepspeed_config` is a dict or a JSON path. Compression starts when compression_scheduler's steps
    reach each method's schedule_offset. With layer_reduction the student `model` first takes the chosen layers
    of `teacher_model`. `mpu` is not used.
    """
    plan = resolve_compression(load_config(deepspeed_config))
    if plan.layer_reduction is not None:
        initialize_student(_target(model), teacher_model, plan.layer_reduction)
    _apply(_target(model), plan)
    return model


def redundancy_clean(model: nn.Module, deepspeed_config: object, mpu: object | None = None) -> nn.Module:
    """Bake each compressed layer's current weight (quantized, masked) into a plain layer, in place, and remove
    the rows, heads and channels pruned in groups that name their `related_modules`."""
    bake_and_shrink(_target(model), resolve_compression(load_config(deepspeed_config)).structured)
    return model


class compression_scheduler:  # DeepSpeed's class name
    """Turns compression on at each method's schedule_offset and steps the weight bits; the engine calls step()
    after each optimizer step it applied (and step(step_zero_check=True) before its first forward)."""

    def __init__(self, model: nn.Module, compression_config: object) -> None:
        self.model = model
        self.plan = resolve_compression(load_config(compression_config))
        self.training_steps = 0

    def _layers(self) -> list[Compressed]:
        return [m for m in self.model.modules() if isinstance(m, (CompressedLinear, CompressedConv2d))]

    def step(self, step_zero_check: bool = False) -> None:
        """Count a training step (not when `step_zero_check`), then enable and schedule compression."""
        if not step_zero_check:
            self.training_steps += 1
        quant, prune, activation = self.plan.quantization, self.plan.pruning, self.plan.activation
        for layer in self._layers():
            quantizer = getattr(layer, "input_quantizer", None)
            if activation is not None and isinstance(quantizer, InputQuantizer):
                quantizer.enabled = self.training_steps >= activation.schedule_offset
            for structured in self.plan.structured:
                mask = getattr(layer, structured.name, None)
                if mask is not None:
                    mask.enabled = self.training_steps >= structured.schedule_offset
            if not isinstance(layer, CompressedLinear):
                continue
            if quant is not None and layer.schedule is not None and self.training_steps >= quant.schedule_offset:
                layer.quantization_enabled = True
                if not step_zero_check:
                    layer.schedule.advance(self.training_steps - quant.schedule_offset)
            if prune is not None and (layer.sparse_pruning_mask is not None or layer.sparse_pruning is not None):
                layer.pruning_enabled = self.training_steps >= prune.schedule_offset
