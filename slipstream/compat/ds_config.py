"""`deepspeed.runtime.config`: `DeepSpeedConfig` (a validated config with DeepSpeed's attribute names), the
optimizer-name constants, and DeepSpeed's enums of the ZeRO and offload sections.

`DeepSpeedConfig(config)` reads a dict, a path, or base64 JSON as `initialize()` does and validates it with
`resolve()` for the current data-parallel world, so its errors are `ConfigError` (also importable as
`DeepSpeedConfigError`). The attributes client code reads are computed from the plan: the batch triple,
ZeRO stage and offload, precision, optimizer and scheduler names and params, clipping, printing.
"""

from __future__ import annotations

import enum
from typing import Any

from slipstream.config.errors import ConfigError

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "DEEPSPEED_OPTIMIZERS",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "LAMB_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUON_OPTIMIZER",
    "OffloadDeviceEnum",
    "ZeroStageEnum",
    "get_bfloat16_config",
    "get_float16_config",
]

DeepSpeedConfigError = ConfigError

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
]
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def get_float16_config(param_dict: dict[str, Any]) -> Any:
    from slipstream.config.schema.precision import FP16Config

    return FP16Config(**param_dict.get("fp16", {}))


def get_bfloat16_config(param_dict: dict[str, Any]) -> Any:
    from slipstream.config.schema.precision import BF16Config

    section = param_dict.get("bf16", param_dict.get("bfloat16", {}))
    return BF16Config(**section)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DeepSpeedConfig:
    """A DeepSpeed config, validated (see module doc). `mpu` and `mesh_device` are accepted and unused: the
    data-parallel world is the whole world here."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        del mpu, mesh_device
        from slipstream.config import load_config, resolve

        self._param_dict: dict[str, Any] = load_config(config)
        self.world_size = _world_size()
        self.plan = resolve(self._param_dict, world_size=self.world_size)
        plan = self.plan
        self.train_batch_size = plan.batch.train_batch_size
        self.train_micro_batch_size_per_gpu = plan.batch.micro_batch_size
        self.gradient_accumulation_steps = plan.batch.gradient_accumulation_steps
        self.zero_optimization_stage = plan.zero.stage
        self.zero_enabled = plan.zero.stage > 0
        self.fp16_enabled = plan.precision.param_dtype == "fp16"
        self.bfloat16_enabled = plan.precision.param_dtype == "bf16"
        self.optimizer_name = str(self._section("optimizer").get("type", "")).lower() or None
        self.optimizer_params = None if plan.optimizer is None else dict(self._section("optimizer").get("params", {}))
        self.scheduler_name = self._section("scheduler").get("type")
        self.scheduler_params = None if plan.scheduler is None else dict(self._section("scheduler").get("params", {}))
        self.gradient_clipping = plan.gradient_clipping
        self.gradient_allreduce_op = str(plan.resolved.get("gradient_allreduce_op", "mean"))
        self.steps_per_print = plan.logging.steps_per_print
        self.wall_clock_breakdown = plan.logging.wall_clock_breakdown
        self.zero_allow_untested_optimizer = bool(self._param_dict.get("zero_allow_untested_optimizer", False))
        sparse = plan.sparse_attention  # DeepSpeed's dict: the mode and its keys, defaults filled; None without
        self.sparse_attention = None if sparse is None else sparse.as_dict()

    def _section(self, name: str) -> dict[str, Any]:
        section = self._param_dict.get(name)
        return section if isinstance(section, dict) else {}

    @property
    def zero_config(self) -> Any:
        from slipstream.config.schema.zero import ZeroConfig

        return ZeroConfig(**self._section("zero_optimization"))

    def print(self, name: str) -> None:
        import json

        print(f"{name}:\n{json.dumps(self._param_dict, indent=2, sort_keys=True, default=str)}")
