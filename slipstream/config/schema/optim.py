"""The `optimizer` and `scheduler` sections.

DeepSpeed's shape is `{"type": ..., "params": {...}}`. `params` is free-form here because it is passed to the
optimizer or scheduler constructor; the name rules (lower-casing DeepSpeed's own optimizer names,
`adam_w_mode`) and `params.max_grad_norm` are handled in resolve.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from slipstream.config.schema.base import DSBool, DSModel, plan_fields

__all__ = ["OptimizerConfig", "SchedulerConfig"]


class _BuiltClassConfig(DSModel):
    """A section naming a class to build (`type`) and the keyword arguments of its constructor (`params`)."""

    type: str
    """The class: a DeepSpeed name or a torch class name (case-sensitive), listed on the section."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class's constructor."""


class OptimizerConfig(_BuiltClassConfig):
    """`optimizer`: which optimizer DeepSpeed builds when the caller passes none: a DeepSpeed name (adam, adamw,
    lamb, lion, adagrad, ...) or a torch.optim class name, with its keyword arguments (lr, betas, eps, ...)."""

    IMPLEMENTED = plan_fields("optimizer", "params", type="optimizer.name")
    legacy_fusion: DSBool = False
    """Legacy fused fp16 optimizer path."""


class SchedulerConfig(_BuiltClassConfig):
    """`scheduler`: an LR schedule from DeepSpeed's lr_schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
    LRRangeTest) or a torch.optim.lr_scheduler class, with its keyword arguments."""

    IMPLEMENTED = plan_fields("scheduler", "params", type="scheduler.name")
