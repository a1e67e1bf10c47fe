"""The `optimizer` and `scheduler` sections.

DeepSpeed's shape is `{"type": ..., "params": {...}}`. `params` is free-form here because it is passed to the
optimizer or scheduler constructor; the name rules (lower-casing DeepSpeed's own optimizer names,
`adam_w_mode`) and `params.max_grad_norm` are handled in resolve.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from slipstream.config.schema.base import DSBool, DSModel

__all__ = ["OptimizerConfig", "SchedulerConfig"]


class OptimizerConfig(DSModel):
    """`optimizer`: which optimizer DeepSpeed builds when the caller passes none."""

    IMPLEMENTED = {
        "type": "optimizer.name",
        "params": "optimizer.params",
    }
    type: str
    """DeepSpeed name (adam, adamw, lamb, lion, adagrad, ...) or a torch.optim class name (case-sensitive)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, betas, eps, weight_decay, ...)."""
    legacy_fusion: DSBool = False
    """Legacy fused fp16 optimizer path."""


class SchedulerConfig(DSModel):
    """`scheduler`: an LR schedule from DeepSpeed's lr_schedules or torch.optim.lr_scheduler."""

    IMPLEMENTED = {
        "type": "scheduler.name",
        "params": "scheduler.params",
    }
    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, or a torch.optim.lr_scheduler class."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler."""
