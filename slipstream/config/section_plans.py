"""The config's smaller sections as plans: parallelism degrees and TP rules, precision and loss scaling,
activation checkpointing, logging and monitors, checkpoint and pipeline options. One function per section;
each reads the validated schema and fills every plan field from it; the autotuning section too."""

from __future__ import annotations

import os

from pydantic import ValidationError

from slipstream.config.errors import ConfigError, pydantic_problems
from slipstream.config.plan import (
    ActivationCheckpointPlan,
    AutotuningPlan,
    CheckpointPlan,
    CometPlan,
    CommsLogPlan,
    FlopsProfilePlan,
    LoggingPlan,
    LossScalePlan,
    MonitorPlan,
    ParallelPlan,
    PipelinePlan,
    PrecisionPlan,
    WandbPlan,
)
from slipstream.config.precision_plans import autocast_plan, fp8_plan, master_options
from slipstream.config.same_named import same_named as _same_named
from slipstream.config.schema.misc import ActivationCheckpointingConfig
from slipstream.config.schema.top import DeepSpeedConfig

__all__ = [
    "activation_checkpoint_plan",
    "activation_plan",
    "autotuning_plan",
    "checkpoint_plan",
    "logging_plan",
    "param_dtype_of",
    "parallel_plan",
    "pipeline_plan",
    "precision_plan",
]


def parallel_plan(cfg: DeepSpeedConfig, world_size: int, problems: list[str]) -> ParallelPlan:
    """TP and SP degrees; the world must be a multiple of their product (the rest is data parallel)."""
    tp_section = cfg.tensor_parallel
    tp, sp = max(tp_section.autotp_size, 1), cfg.sequence_parallel_size or 1
    if world_size % (tp * sp):
        problems.append(
            f"tensor_parallel.autotp_size ({tp}) x sequence_parallel_size ({sp}) = {tp * sp} does not divide the "
            f"world size {world_size}; launch a multiple of {tp * sp} ranks or change the sizes"
        )
        tp = sp = 1
    rules: list[tuple[str, str]] = []
    partition = tp_section.partition_config
    if partition:
        for number, spec in enumerate(partition.get("layer_specs") or []):
            where = f"tensor_parallel.partition_config.layer_specs[{number}]"
            extra = sorted(set(spec) - {"patterns", "partition_type", "gather_output"})
            kind = str(spec.get("partition_type", "")).lower()
            if extra:
                problems.append(
                    f"{where}: {', '.join(extra)} not implemented (sub-parameter splits); use whole-layer "
                    "rules with patterns, partition_type and gather_output"
                )
            if kind not in ("column", "row", "skip"):
                problems.append(f"{where}.partition_type: expected 'column', 'row' or 'skip', got {kind!r}")
            kind = "gathered" if kind == "column" and spec.get("gather_output") else kind
            rules += [(str(pattern), kind) for pattern in spec.get("patterns") or []]
        if not partition.get("use_default_specs", True):
            rules.append((".*", "skip"))  # no built-in rules: every other layer stays replicated
    return ParallelPlan(tp_size=tp, tp_rules=tuple(rules), sp_size=sp)


def param_dtype_of(cfg: DeepSpeedConfig) -> str:
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def precision_plan(cfg: DeepSpeedConfig, problems: list[str]) -> PrecisionPlan:
    fp16, bf16, accum = cfg.fp16, cfg.bf16, cfg.data_types.grad_accum_dtype
    if fp16.enabled and bf16.enabled:
        problems.append("fp16.enabled, bf16.enabled: both are true; enable at most one of fp16 and bf16")
    autocast = autocast_plan(cfg, problems)
    scale = None
    if fp16.enabled or (autocast is not None and autocast.dtype == "fp16"):  # fp16 autocast scales the loss too
        scale = LossScalePlan(
            static_scale=fp16.loss_scale if fp16.loss_scale > 0 else None,
            initial_scale_power=fp16.initial_scale_power,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=fp16.min_loss_scale,
        )
    param_dtype = param_dtype_of(cfg)
    masters = master_options(cfg, param_dtype, problems)
    return PrecisionPlan(
        param_dtype=param_dtype,
        grad_accum_dtype=masters.grad_dtype or accum or "fp32",
        master_dtype=masters.master_dtype,
        optimizer_state_dtype=masters.state_dtype,
        master_rounding=masters.rounding,
        autocast=autocast,
        fp8=fp8_plan(cfg, problems),
        buffer_dtype=cfg.data_types.buffer_dtype,
        grad_predivide=None if cfg.prescale_gradients else cfg.gradient_predivide_factor,
        loss_scale=scale,
        check_grad_overflow=scale is not None
        or {"fp16": True, "bf16": bf16.check_grad_overflow, "fp32": False}[param_dtype],
        max_consecutive_skips=cfg.max_consecutive_skipped_steps,
    )


def activation_plan(cfg: DeepSpeedConfig) -> ActivationCheckpointPlan | None:
    """The `activation_checkpointing` section's plan when the config has one (None leaves
    slipstream.checkpointing's own configuration alone)."""
    if "activation_checkpointing" not in cfg.model_fields_set:
        return None
    return _section_plan(cfg.activation_checkpointing)


def _section_plan(section: ActivationCheckpointingConfig) -> ActivationCheckpointPlan:
    plan: ActivationCheckpointPlan = _same_named(
        section, ActivationCheckpointPlan, synchronize=section.synchronize_checkpoint_boundary
    )
    return plan


def activation_checkpoint_plan(section: dict[str, object]) -> ActivationCheckpointPlan:
    """The plan of a raw `activation_checkpointing` section alone (slipstream.checkpointing.configure's
    `deepspeed_config`); a bad key raises ConfigError as a whole config would."""
    try:
        return _section_plan(ActivationCheckpointingConfig.model_validate(section))
    except ValidationError as exc:
        raise ConfigError(pydantic_problems(exc, prefix=("activation_checkpointing",))) from None


def logging_plan(cfg: DeepSpeedConfig) -> LoggingPlan:
    csv, board, wandb, comet = cfg.csv_monitor, cfg.tensorboard, cfg.wandb, cfg.comet
    monitor = MonitorPlan(
        csv_output_path=csv.output_path if csv.enabled else None,
        csv_job_name=csv.job_name,
        tensorboard_output_path=board.output_path if board.enabled else None,
        tensorboard_job_name=board.job_name,
        wandb=_same_named(wandb, WandbPlan) if wandb.enabled else None,
        comet=_same_named(comet, CometPlan) if comet.enabled else None,
    )
    flops, comms = cfg.flops_profiler, cfg.comms_logger
    return LoggingPlan(
        steps_per_print=cfg.steps_per_print,
        wall_clock_breakdown=cfg.wall_clock_breakdown,
        monitor=monitor,
        flops_profile=_same_named(flops, FlopsProfilePlan) if flops.enabled else None,
        comms_log=_same_named(comms, CommsLogPlan, prof_ops=tuple(comms.prof_ops)) if comms.enabled else None,
        throughput_timer=cfg.timers.throughput.enabled,
        throughput_synchronized=cfg.timers.throughput.synchronized,
    )


def autotuning_plan(cfg: DeepSpeedConfig) -> AutotuningPlan:
    section = cfg.autotuning
    return _same_named(
        section,
        AutotuningPlan,
        metric_path=section.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json"),
        min_micro_batch_size=section.min_train_micro_batch_size_per_gpu,
        max_micro_batch_size=section.max_train_micro_batch_size_per_gpu,
        arg_mappings=dict(section.arg_mappings or {}),
    )


def checkpoint_plan(cfg: DeepSpeedConfig) -> CheckpointPlan:
    return CheckpointPlan(tag_validation=cfg.checkpoint.tag_validation, load_universal=cfg.checkpoint.load_universal)


def pipeline_plan(cfg: DeepSpeedConfig) -> PipelinePlan:
    return PipelinePlan(activation_checkpoint_interval=cfg.pipeline.activation_checkpoint_interval)
