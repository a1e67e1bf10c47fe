"""The `zero_optimization` and `aio` sections as plans: ZeroPlan, Stage3Plan, ZenFlowPlan, AioPlan, and the one
place an offload section's `device` string becomes an OffloadTarget type.

DeepSpeed's `stage3_*` names become the components' names here (Stage3Plan), and nowhere else. Every value
comes from the schema (schema/zero.py, schema/misc.py): a config that sets nothing gets the schema's defaults,
which `default_stage3_plan()` and `default_aio_plan()` give to code that runs without a config.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from slipstream.config.errors import ConfigWarning
from slipstream.config.plan import (
    OFFLOAD_TARGETS,
    AioPlan,
    CpuTarget,
    LocoPlan,
    NoOffloadTarget,
    NvmeTarget,
    OffloadTarget,
    Stage3Plan,
    ZenFlowPlan,
    ZeroPlan,
)
from slipstream.config.schema.misc import AioConfig
from slipstream.config.schema.top import DeepSpeedConfig
from slipstream.config.schema.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from slipstream.config.section_plans import _same_named

__all__ = [
    "aio_plan",
    "default_aio_plan",
    "default_stage3_plan",
    "offload_target",
    "stage3_plan",
    "unhonoured_at_stage",
    "zero_plan",
]


def aio_plan(aio: AioConfig) -> AioPlan:
    """Each AioPlan field is the `aio` key of the same name."""
    plan: AioPlan = _same_named(aio, AioPlan)
    return plan


def default_aio_plan() -> AioPlan:
    """The `aio` section's defaults (the schema's), for tools that run without a config (`slipstream io`)."""
    return aio_plan(AioConfig())


def offload_target(section: OffloadOptimizerConfig | OffloadParamConfig | None, aio: AioPlan) -> OffloadTarget:
    """The one place an offload section's `device` string becomes a type (the target whose `kind` it is)."""
    if section is None:
        return NoOffloadTarget()
    by_kind = {target.kind: target for target in OFFLOAD_TARGETS}
    return by_kind[section.device].from_section(section, aio)


def zero_plan(cfg: DeepSpeedConfig, aio: AioPlan, problems: list[str], *, grad_accum_dtype: str) -> ZeroPlan:
    """`grad_accum_dtype`: the precision plan's; gradients travel in it unless communication_data_type is set."""
    zero, prefix = cfg.zero_optimization, "zero_optimization"
    offload = offload_target(zero.offload_optimizer, aio)
    off = zero.offload_optimizer
    if off is not None and offload.on_host:
        if isinstance(offload, NvmeTarget) and not off.nvme_path:
            problems.append(f'{prefix}.offload_optimizer.nvme_path: required with device "nvme"; set a directory')
        if off.ratio < 1.0 and zero.stage != 3:
            problems.append(f"{prefix}.offload_optimizer.ratio: {off.ratio} < 1 needs stage 3; set ratio to 1.0")
        if zero.stage == 0:
            warnings.warn(
                f"{prefix}.offload_optimizer has no effect at stage 0; set {prefix}.stage to 1, 2 or 3",
                ConfigWarning,
                stacklevel=3,
            )
    param_off = offload_target(zero.offload_param, aio)
    if param_off.on_host and zero.stage != 3:
        warnings.warn(
            f"{prefix}.offload_param has no effect below stage 3 (stage is {zero.stage})",
            ConfigWarning,
            stacklevel=3,
        )
    stage3 = None
    if zero.stage == 3:
        stage3 = stage3_plan(zero, param_off, problems)
        problems += _param_offload_problems(stage3.offload_param, offload, prefix)
        if stage3.shard_size is not None and stage3.secondary_shard_size > 1:
            problems.append(
                f"{prefix}.zero_hpz_partition_size: {stage3.secondary_shard_size} together with mics_shard_size "
                f"{stage3.shard_size}; MiCS already keeps the gathers inside its shard groups: set one of them only"
            )
    return ZeroPlan(
        stage=zero.stage,
        reduce_bucket_size=zero.reduce_bucket_size,
        offload_optimizer=offload,
        stage3=stage3,
        force_host_optimizer=cfg.zero_force_ds_cpu_optimizer,
        allow_untested_optimizer=cfg.zero_allow_untested_optimizer,
        zenflow=_zenflow_plan(zero, offload, problems),
        overlap_comm=bool(zero.overlap_comm),
        reduce_dtype=cfg.communication_data_type or grad_accum_dtype,
        sparse_gradients=_sparse_gradients(cfg.sparse_gradients, zero.stage),
    )


def _sparse_gradients(enabled: bool, stage: int) -> bool:
    """sparse_gradients acts at stage 0; DeepSpeed's ZeRO stages reduce embedding gradients dense, and so do ours."""
    if enabled and stage > 0:
        warnings.warn(
            f"sparse_gradients has no effect at zero_optimization.stage {stage} (embedding gradients are reduced "
            "dense there, as in DeepSpeed); set the stage to 0 or remove sparse_gradients",
            ConfigWarning,
            stacklevel=3,
        )
    return enabled and stage == 0


def _zenflow_plan(zero: ZeroConfig, offload: OffloadTarget, problems: list[str]) -> ZenFlowPlan | None:
    """ZenFlow's knobs with DeepSpeed's rules (runtime/zenflow/engine.py, configure_zenflow): "auto" selection is
    once per epoch; an explicit strategy needs an integer interval; selection is no more frequent than updates."""
    section, prefix = zero.zenflow, "zero_optimization.zenflow"
    if section is None:
        return None
    count = len(problems)
    if zero.stage not in (1, 2):
        problems.append(
            f"{prefix}: ZenFlow runs at ZeRO stages 1 and 2 (zero_optimization.stage is {zero.stage}); "
            "set zero_optimization.stage to 1 or 2, or remove the zenflow section"
        )
    if not isinstance(offload, CpuTarget) or isinstance(offload, NvmeTarget):
        device = "none" if zero.offload_optimizer is None else zero.offload_optimizer.device
        problems.append(
            f'{prefix}: ZenFlow needs zero_optimization.offload_optimizer.device "cpu" (it is "{device}"); '
            'set it to "cpu", or remove the zenflow section'
        )
    strategy, interval = section.select_strategy, section.select_interval
    if strategy not in ("auto", "step", "epoch"):
        problems.append(f'{prefix}.select_strategy: {strategy!r} is not one of "auto", "step", "epoch"')
    elif strategy == "auto" and interval != "auto":
        problems.append(
            f'{prefix}.select_interval: {interval!r} is not used with select_strategy "auto" (which selects once '
            'per epoch); set select_strategy to "step" or "epoch", or select_interval to "auto"'
        )
    elif strategy != "auto" and interval == "auto":
        problems.append(
            f'{prefix}.select_interval: "auto" needs select_strategy "auto" (it is "{strategy}"); '
            "give the number of steps or epochs between selections"
        )
    update = None if section.update_interval == "auto" else int(section.update_interval)
    every = 1 if interval == "auto" else int(interval)
    if update is not None and update < 1:
        problems.append(f'{prefix}.update_interval: {update} < 1; give a positive number of steps or "auto"')
    if strategy == "step" and update is not None and 0 < every < update:
        problems.append(
            f"{prefix}.select_interval: {every} is below update_interval {update}; selection must not be more "
            "frequent than the CPU updates (DeepSpeed refuses this too)"
        )
    if len(problems) > count:
        return None
    return ZenFlowPlan(
        topk_ratio=section.topk_ratio,
        select_every=every,
        select_per_epoch=strategy != "step",
        update_interval=update,
        full_warm_up_rounds=section.full_warm_up_rounds,
        overlap_step=section.overlap_step,
        offload=section.offload,
    )


def _param_offload_problems(param_off: OffloadTarget, optimizer_off: OffloadTarget, prefix: str) -> list[str]:
    if not isinstance(param_off, NvmeTarget):
        return []
    problems = []
    if not param_off.path:
        problems.append(
            f'{prefix}.offload_param.nvme_path: required with device "nvme"; set it to a directory on a fast local disk'
        )
    if not optimizer_off.on_host:
        problems.append(
            f'{prefix}.offload_param.device: "nvme" needs offload_optimizer too (device cpu or nvme): '
            "the fp32 master weights cannot live in the NVMe-resident shards"
        )
    return problems


_STAGE3_FROM_ZERO = {
    "prefetch_numel": "prefetch_bucket_size",
    "persistence_threshold": "param_persistence_threshold",
    "max_live_numel": "max_live_parameters",
    "reuse_distance": "max_reuse_distance",
    "gather_16bit_on_save": "gather_16bit_weights_on_model_save",
    "sub_group_numel": "sub_group_size",
    "quantized_weights": "zero_quantized_weights",
    "quantized_frozen_weights": "zero_quantized_nontrainable_weights",
    "quantized_gradients": "zero_quantized_gradients",
}
"""Stage3Plan field -> the ZeroConfig field it is copied from (DeepSpeed's key, without the stage3_ prefix)."""


def stage3_plan(zero: ZeroConfig, offload_param: OffloadTarget, problems: list[str] | None = None) -> Stage3Plan:
    """DeepSpeed's stage3_* names become the components' names here (`_STAGE3_FROM_ZERO`), and nowhere else."""
    leaf = zero.leaf_module
    shard_size = zero.mics_shard_size if zero.mics_shard_size > 0 else None
    return Stage3Plan(
        offload_param=offload_param,
        leaf_classes=tuple(leaf.classes),
        leaf_names=tuple(leaf.names),
        leaf_suffixes=tuple(leaf.name_suffixes),
        secondary_shard_size=zero.zero_hpz_partition_size,
        shard_size=shard_size,
        hierarchical_gather=zero.mics_hierarchical_params_gather and shard_size is not None,
        loco=loco_plan(zero, [] if problems is None else problems),
        **{field: getattr(zero, key) for field, key in _STAGE3_FROM_ZERO.items()},
    )


def loco_plan(zero: ZeroConfig, problems: list[str]) -> LocoPlan | None:
    """`zeropp_loco_param` ({"err_beta": b, "reset_T": T}, both required as in DeepSpeed) as a LocoPlan; None
    without zero_quantized_gradients (the key is then reported, see `unhonoured_at_stage`)."""
    section, prefix = zero.zeropp_loco_param, "zero_optimization.zeropp_loco_param"
    if section is None or not zero.zero_quantized_gradients:
        return None
    count = len(problems)
    problems += [f"{prefix}.{key}: not a LoCo key; give err_beta and reset_T" for key in section if key not in _LOCO]
    for key, check in _LOCO.items():
        value = section.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not check(value):
            problems.append(f"{prefix}.{key}: {value!r} is not {_LOCO_TEXT[key]}")
    if len(problems) > count:
        return None
    return LocoPlan(err_beta=float(section["err_beta"]), reset_every=int(section["reset_T"]))


_LOCO = {"err_beta": lambda v: 0 <= v < 1, "reset_T": lambda v: float(v).is_integer() and v >= 1}
_LOCO_TEXT = {
    "err_beta": "a number in [0, 1) (the weight of the kept error; DeepSpeed's example is 0.8)",
    "reset_T": "an integer >= 1 (reductions between resets of the kept error; DeepSpeed's example is 1024)",
}


def default_stage3_plan(**changes: Any) -> Stage3Plan:
    """The stage-3 plan of a config that sets nothing (the schema's defaults), with `changes` applied."""
    return dataclasses.replace(stage3_plan(ZeroConfig(), NoOffloadTarget()), **changes)


def unhonoured_at_stage(zero: ZeroConfig) -> list[str]:
    """Keys the config sets that the chosen stage does not act on (reported as not implemented): stage 3
    reduce-scatters each unit's gradients in one collective when the unit's backward completes, so
    `reduce_bucket_size` (DeepSpeed's stage-3 gradient bucket) has no effect there; stage 0 all-reduces at
    the step, never during backward, so `overlap_comm` true has nothing to overlap there; only stage 3 gathers
    parameters, so the quantized-weight keys act there alone, and qgZ replaces stage 3's unit reduce-scatter."""
    unhonoured = []
    if zero.stage == 3 and "reduce_bucket_size" in zero.model_fields_set:
        unhonoured.append("zero_optimization.reduce_bucket_size")
    if zero.stage == 0 and zero.overlap_comm and "overlap_comm" in zero.model_fields_set:
        unhonoured.append("zero_optimization.overlap_comm")
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if zero.stage != 3 and getattr(zero, key):
            unhonoured.append(f"zero_optimization.{key}")
    if zero.stage != 3 and zero.zero_hpz_partition_size > 1:  # hpZ and MiCS shard parameters: stage 3 only
        unhonoured.append("zero_optimization.zero_hpz_partition_size")
    if zero.stage != 3 and zero.mics_shard_size > 0:
        unhonoured.append("zero_optimization.mics_shard_size")
    if zero.zeropp_loco_param is not None and not (zero.stage == 3 and zero.zero_quantized_gradients):
        unhonoured.append("zero_optimization.zeropp_loco_param")  # LoCo compensates qgZ's quantizations only
    if zero.mics_hierarchical_params_gather and not (zero.stage == 3 and zero.mics_shard_size > 0):
        unhonoured.append("zero_optimization.mics_hierarchical_params_gather")  # a MiCS gather's two steps
    return unhonoured
