"""DeepSpeed JSON config, parsed once at the edge: load_config() reads it, resolve() validates it against the
pydantic schema (schema/) and returns frozen plans (plan.py). See resolve.py for the rules and for "auto"."""

from __future__ import annotations

from slipstream.config.errors import ConfigError, ConfigWarning
from slipstream.config.load import load_config
from slipstream.config.plan import (
    AioPlan,
    BatchPlan,
    CheckpointPlan,
    CpuTarget,
    EnginePlan,
    LoggingPlan,
    LossScalePlan,
    MonitorPlan,
    NoOffloadTarget,
    NvmeTarget,
    OffloadTarget,
    OptimizerPlan,
    PrecisionPlan,
    SchedulerPlan,
    Stage3Plan,
    ZeroPlan,
)
from slipstream.config.resolve import collective_timeout_of, resolve

__all__ = [
    "AioPlan",
    "BatchPlan",
    "CheckpointPlan",
    "ConfigError",
    "ConfigWarning",
    "CpuTarget",
    "EnginePlan",
    "LoggingPlan",
    "LossScalePlan",
    "MonitorPlan",
    "NoOffloadTarget",
    "NvmeTarget",
    "OffloadTarget",
    "OptimizerPlan",
    "PrecisionPlan",
    "SchedulerPlan",
    "Stage3Plan",
    "ZeroPlan",
    "collective_timeout_of",
    "load_config",
    "resolve",
]
