"""Precision sections: `fp16`, `bf16` (alias `bfloat16`), `amp`, `torch_autocast`, `data_types`, and
Slipstream's own `fp8`.

Defaults are DeepSpeed 0.19's (`runtime/precision_config.py`). The loss-scale rules (finite >= 0; window and
minimum scale > 0 when dynamic) are checked here; fp16-with-bf16 is a cross-section rule in resolve.py.
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, DSModel, OpenSection

__all__ = [
    "AmpConfig",
    "BF16Config",
    "DataTypesConfig",
    "FP16Config",
    "Fp8Config",
    "TorchAutocastConfig",
    "canonical_dtype",
]

_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def canonical_dtype(value: str | None) -> str | None:
    """ "fp32" | "fp16" | "bf16" for any DeepSpeed/torch spelling; ValueError naming the choices otherwise."""
    if value is None:
        return None
    found = _DTYPE_NAMES.get(value.lower())
    if found is None:
        raise ValueError(f'unknown dtype \'{value}\'; expected one of "fp32", "fp16", "bf16"')
    return found


class FP16Config(DSModel):
    """`fp16`: mixed precision with float16 parameters and a loss scaler."""

    IMPLEMENTED = {
        "enabled": "precision.param_dtype",
        "loss_scale": "precision.loss_scale.static_scale",
        "initial_scale_power": "precision.loss_scale.initial_scale_power",
        "loss_scale_window": "precision.loss_scale.window",
        "hysteresis": "precision.loss_scale.hysteresis",
        "consecutive_hysteresis": "precision.loss_scale.consecutive_hysteresis",
        "min_loss_scale": "precision.loss_scale.min_scale",
        "fp16_master_weights_and_grads": "precision.master_dtype",
        "auto_cast": "precision.param_dtype",
    }
    enabled: DSBool = False
    """Train with float16 parameters."""
    auto_cast: DSBool = False
    """Cast floating-point inputs of the model to fp16 (Slipstream casts them to the parameter dtype either way)."""
    loss_scale: DSFloat = 0.0
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: DSInt = Field(16, ge=0)
    """The dynamic scale starts at 2**initial_scale_power."""
    loss_scale_window: DSInt = 1000
    """Steps without overflow before the dynamic scale is doubled."""
    hysteresis: DSInt = Field(2, ge=1)
    """Overflows tolerated before the dynamic scale is halved."""
    consecutive_hysteresis: DSBool = False
    """Refill hysteresis on every step without overflow."""
    min_loss_scale: DSFloat = 1.0
    """Lower bound of the dynamic loss scale."""
    fp16_master_weights_and_grads: DSBool = False
    """Keep master weights and gradients in fp16 (ZeRO with CPU offload only)."""

    @field_validator("loss_scale")
    @classmethod
    def _finite_non_negative(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"loss_scale must be a finite number >= 0 (0 means dynamic), got {value}")
        return value

    @model_validator(mode="after")
    def _dynamic_bounds(self) -> FP16Config:
        if self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError(
                    f"loss_scale_window must be > 0 for dynamic loss scaling, got {self.loss_scale_window}"
                )
            if self.min_loss_scale <= 0:
                raise ValueError(f"min_loss_scale must be > 0 for dynamic loss scaling, got {self.min_loss_scale}")
        return self


class BF16Config(DSModel):
    """`bf16` (also spelled `bfloat16`): bfloat16 parameters with fp32 master weights."""

    IMPLEMENTED = {
        "enabled": "precision.param_dtype",
        "check_grad_overflow": "precision.check_grad_overflow",
        "bf16_master_weights_and_grads": "precision.master_dtype",
        "bf16_optimizer_states": "precision.optimizer_state_dtype",
        "immediate_grad_update": "precision.grad_accum_dtype",
        "stochastic_rounding": "precision.master_rounding",
    }
    enabled: DSBool = False
    """Train with bfloat16 parameters."""
    immediate_grad_update: DSBool = False
    """Add each gradient into the accumulation storage as it is produced and free the bf16 gradient (what
    Slipstream does at every stage, with or without the key)."""
    check_grad_overflow: DSBool = True
    """Skip the step when a gradient is not finite."""
    bf16_master_weights_and_grads: DSBool = False
    """Keep master weights and gradients in bf16 (ZeRO 1-3)."""
    bf16_optimizer_states: DSBool = False
    """Keep optimizer states in bf16; requires bf16_master_weights_and_grads."""
    stochastic_rounding: DSBool = False
    """Slipstream's own: store the optimizer's new bf16 master values rounded stochastically (unbiased) instead
    of to nearest; needs bf16_master_weights_and_grads and an Adam/AdamW optimizer on the accelerator."""

    @model_validator(mode="after")
    def _states_need_master(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states requires bf16_master_weights_and_grads: true")
        return self


class AmpConfig(OpenSection):
    """`amp`: NVIDIA Apex AMP, which DeepSpeed 0.19 no longer has; `enabled` runs the forward under
    torch.autocast in fp16 with dynamic loss scaling (what Apex's O1 does). Other Apex keywords are reported."""

    IMPLEMENTED = {"enabled": "precision.autocast"}

    enabled: DSBool = False
    """Use Apex AMP."""
    opt_level: str | None = None
    """Apex optimisation level, e.g. "O1"."""


class TorchAutocastConfig(DSModel):
    """`torch_autocast`: run forward under torch.autocast."""

    IMPLEMENTED = {
        "enabled": "precision.autocast",
        "dtype": "precision.autocast.dtype",
        "lower_precision_safe_modules": "precision.autocast.safe_modules",
    }

    enabled: DSBool = False
    """Use torch.autocast in forward."""
    dtype: str | None = None
    """Autocast dtype, e.g. "bfloat16"."""
    lower_precision_safe_modules: list[str] | None = None
    """Class paths ("torch.nn.Linear") of the modules whose parameters' gradients are reduced in the autocast
    dtype; the others' in fp32. None: Linear and Conv1d/2d/3d."""


class DataTypesConfig(DSModel):
    """`data_types`: dtypes of gradient accumulation, parameters and buffers."""

    IMPLEMENTED = {
        "grad_accum_dtype": "precision.grad_accum_dtype",
        "param_dtype": "precision.param_dtype",
        "buffer_dtype": "precision.buffer_dtype",
    }
    grad_accum_dtype: str | None = None
    """Gradient accumulation dtype: "fp32", "fp16" or "bf16" (None: fp32 in Slipstream)."""
    param_dtype: str | None = None
    """The parameter dtype; must match the fp16/bf16 sections (it changes nothing else)."""
    buffer_dtype: str | None = None
    """Cast every floating-point buffer (running statistics, rotary caches) to this dtype after placement."""

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        return canonical_dtype(value)


FP8_RECIPES = ("tensorwise", "rowwise")


class Fp8Config(DSModel):
    """`fp8`: FP8 training of linear layers, Slipstream's own section (DeepSpeed has none): the model's
    nn.Linear modules become slipstream.fp8.Float8Linear before ZeRO wraps the model."""

    IMPLEMENTED = {
        "enabled": "precision.fp8",
        "recipe": "precision.fp8.recipe",
        "emulate": "precision.fp8.emulate",
        "exclude_modules": "precision.fp8.exclude_modules",
    }
    enabled: DSBool = False
    """Run the linear layers' matmuls in float8."""
    recipe: str = "tensorwise"
    """Scaling: "tensorwise" (one scale per tensor) or "rowwise" (one per row of each product)."""
    emulate: DSBool = False
    """Emulate the float8 matmuls in fp32 (any device; for correctness checks, not speed)."""
    exclude_modules: list[str] = Field(default_factory=list)
    """Names (or name prefixes) of linear modules to keep in high precision, e.g. "lm_head"."""

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, value: str) -> str:
        if value not in FP8_RECIPES:
            raise ValueError(f"fp8.recipe={value!r} is not one of {FP8_RECIPES}; use 'tensorwise' or 'rowwise'")
        return value
