"""The precision options beyond the parameter dtype, as plan fields: the forward under torch.autocast
(`torch_autocast`, `amp`) and low-precision master weights and optimizer states (`bf16.bf16_master_weights_and_grads`,
`bf16.bf16_optimizer_states`, `fp16.fp16_master_weights_and_grads`). Each rule DeepSpeed enforces for them is
a problem naming the keys here."""

from __future__ import annotations

import dataclasses

from slipstream.config.schema.precision import canonical_dtype
from slipstream.config.schema.top import DeepSpeedConfig

__all__ = [
    "DEFAULT_SAFE_MODULES",
    "AutocastPlan",
    "Fp8Plan",
    "MasterOptions",
    "autocast_plan",
    "fp8_plan",
    "master_options",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AutocastPlan:
    """The forward runs under torch.autocast with `dtype` while the parameters stay fp32 (`torch_autocast`, or
    `amp` mapped onto it); slipstream/precision/autocast.py applies it. A field of `PrecisionPlan`."""

    dtype: str | None
    """"bf16" or "fp16"; None: torch.autocast's default for the device (bf16 on CPU, fp16 on CUDA)."""
    safe_modules: tuple[str, ...]
    """Class paths of the modules whose parameters' gradients are reduced in the autocast dtype
    (`torch_autocast.lower_precision_safe_modules`; slipstream/precision/reduce_dtypes.py); empty for `amp`."""


def autocast_plan(cfg: DeepSpeedConfig, problems: list[str]) -> AutocastPlan | None:
    """`torch_autocast.enabled` (its `dtype`; unset, torch.autocast's default for the device) or `amp.enabled`
    (fp16, as Apex's O1 casts to fp16) as an AutocastPlan; either contradicts fp16/bf16 parameters, and they
    exclude each other."""
    torch_section, amp = cfg.torch_autocast, cfg.amp
    chosen: list[tuple[str, AutocastPlan]] = []
    if torch_section.enabled:
        dtype, safe = _autocast_dtype(torch_section.dtype, problems), torch_section.lower_precision_safe_modules
        chosen.append(("torch_autocast", AutocastPlan(dtype=dtype, safe_modules=_safe_modules(safe, problems))))
    if amp is not None and amp.enabled:
        chosen.append(("amp", AutocastPlan(dtype="fp16", safe_modules=())))
    if len(chosen) > 1:
        problems.append(
            "torch_autocast.enabled, amp.enabled: both run the forward under torch.autocast; enable only "
            "torch_autocast (amp is its older spelling)"
        )
    if not chosen:
        return None
    section, autocast = chosen[0]
    low = [name for name, low_section in (("fp16", cfg.fp16), ("bf16", cfg.bf16)) if low_section.enabled]
    if low:
        problems.append(
            f"{section}.enabled, {low[0]}.enabled: autocast keeps the parameters in fp32 while {low[0]} makes "
            f"them {low[0]}; disable {low[0]} (autocast picks the compute dtype) or {section}"
        )
    return autocast


DEFAULT_SAFE_MODULES = (
    "torch.nn.modules.linear.Linear",
    "torch.nn.modules.conv.Conv1d",
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.modules.conv.Conv3d",
)
"""DeepSpeed's default `lower_precision_safe_modules`: Linear and the convolutions."""


def _safe_modules(names: list[str] | None, problems: list[str]) -> tuple[str, ...]:
    """The configured class paths (None: `DEFAULT_SAFE_MODULES`); each must name a class in a module."""
    if names is None:
        return DEFAULT_SAFE_MODULES
    for name in names:
        parts = name.split(".")
        if len(parts) < 2 or "" in parts:
            problems.append(
                f"torch_autocast.lower_precision_safe_modules: {name!r} is not a class path; name the class with "
                'its module, e.g. "torch.nn.Linear" or "mypackage.layers.MyLinear"'
            )
    return tuple(names)


def _autocast_dtype(value: str | None, problems: list[str]) -> str | None:
    """The configured dtype, canonical; None when unset (torch.autocast's default for the device)."""
    if value is None:
        return None
    try:
        dtype = canonical_dtype(value)
    except ValueError as error:
        problems.append(f"torch_autocast.dtype: {error}")
        return None
    if dtype == "fp32":
        problems.append(
            f'torch_autocast.dtype={value!r}: autocast needs a lower precision; use "bfloat16" or "float16"'
        )
        return None
    return dtype


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Plan:
    """The `fp8` section (Slipstream's own): which linear layers run their matmuls in float8 and how;
    slipstream/precision/fp8.py applies it. A field of `PrecisionPlan`."""

    recipe: str
    """"tensorwise" or "rowwise" scaling."""
    emulate: bool
    exclude_modules: tuple[str, ...]
    """Module names, or prefixes of them, that stay nn.Linear."""


def fp8_plan(cfg: DeepSpeedConfig, problems: list[str]) -> Fp8Plan | None:
    """`fp8.enabled` as an Fp8Plan; the layers keep fp32 or bf16 weights, so fp16 parameters contradict it."""
    section = cfg.fp8
    if not section.enabled:
        return None
    if cfg.fp16.enabled:
        problems.append(
            "fp8.enabled, fp16.enabled: float8 linear layers keep fp32 or bf16 weights; use bf16 or fp32 "
            "parameters with fp8, or disable fp8"
        )
    return Fp8Plan(recipe=section.recipe, emulate=section.emulate, exclude_modules=tuple(section.exclude_modules))


@dataclasses.dataclass(frozen=True, slots=True)
class MasterOptions:
    """Dtypes of the master weights, their gradients and the optimizer's moments."""

    master_dtype: str
    grad_dtype: str | None
    """The gradients' dtype when the masters set it (they are the masters' gradients), else None."""
    state_dtype: str
    rounding: str
    """"nearest", or "stochastic" with `bf16.stochastic_rounding`."""


def master_options(cfg: DeepSpeedConfig, param_dtype: str, problems: list[str]) -> MasterOptions:
    """fp32 masters by default; bf16 or fp16 masters (and gradients) with the `*_master_weights_and_grads`
    keys, under DeepSpeed's rules: ZeRO 1-3, the matching parameter dtype, and CPU optimizer offload unless
    the moments are bf16 too (fp16 masters always need it). `data_types.param_dtype`, when set, must name the
    parameter dtype the fp16/bf16 sections give (DeepSpeed checks the same)."""
    bf16, fp16 = cfg.bf16, cfg.fp16
    named = cfg.data_types.param_dtype
    if named is not None and named != param_dtype:
        problems.append(
            f"data_types.param_dtype={named!r}: the parameters are {param_dtype} (the fp16 and bf16 sections "
            f"decide); enable the matching section or remove data_types.param_dtype"
        )
    if bf16.bf16_master_weights_and_grads and fp16.fp16_master_weights_and_grads:
        problems.append("bf16.bf16_master_weights_and_grads, fp16.fp16_master_weights_and_grads: enable at most one")
    rounding = _master_rounding(cfg, problems)
    if bf16.bf16_master_weights_and_grads:
        _check_low_masters(cfg, "bf16", need_offload=not bf16.bf16_optimizer_states, problems=problems)
        return MasterOptions("bf16", "bf16", "bf16" if bf16.bf16_optimizer_states else "fp32", rounding)
    if fp16.fp16_master_weights_and_grads:
        _check_low_masters(cfg, "fp16", need_offload=True, problems=problems)
        return MasterOptions("fp16", "fp16", "fp32", rounding)
    return MasterOptions("fp32", None, "fp32", rounding)


def _master_rounding(cfg: DeepSpeedConfig, problems: list[str]) -> str:
    """`bf16.stochastic_rounding` (Slipstream's own): the optimizer on the accelerator steps bf16 masters."""
    if not cfg.bf16.stochastic_rounding:
        return "nearest"
    if not cfg.bf16.bf16_master_weights_and_grads:
        problems.append(
            "bf16.stochastic_rounding: it rounds the update stored in bf16 master weights; set "
            "bf16.bf16_master_weights_and_grads true (with fp32 masters nothing is rounded to bf16)"
        )
    zero = cfg.zero_optimization
    if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none":
        problems.append(
            f"bf16.stochastic_rounding: the offloaded optimizer (offload_optimizer.device "
            f"{zero.offload_optimizer.device!r}) is the CPU Adam op, which rounds to nearest in its own pass; "
            "remove the offload or set bf16.stochastic_rounding false"
        )
    return "stochastic"


def _check_low_masters(cfg: DeepSpeedConfig, dtype: str, *, need_offload: bool, problems: list[str]) -> None:
    key = f"{dtype}.{dtype}_master_weights_and_grads"
    if not getattr(cfg, dtype).enabled:
        problems.append(f"{key}: needs {dtype}.enabled true (the masters are the {dtype} parameters)")
    zero = cfg.zero_optimization
    if zero.stage == 0:
        problems.append(f"{key}: needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)")
    device = zero.offload_optimizer.device if zero.offload_optimizer is not None else "none"
    if need_offload and device != "cpu":
        why = "fp32 optimizer states of bf16 masters" if dtype == "bf16" else "fp16 masters"
        fix = " or set bf16.bf16_optimizer_states true" if dtype == "bf16" else ""
        problems.append(
            f"{key}: {why} need CPU optimizer offload (zero_optimization.offload_optimizer.device is "
            f'{device!r}); set it to "cpu"{fix}'
        )
    accum = cfg.data_types.grad_accum_dtype
    if accum is not None and accum != dtype:
        problems.append(
            f"{key}, data_types.grad_accum_dtype={accum!r}: the gradients are the {dtype} masters' gradients; "
            f"remove data_types.grad_accum_dtype or set it to {dtype!r}"
        )
