"""Turns a DeepSpeed config dict into an EnginePlan: validation, DeepSpeed's defaults, cross-field rules.

Every problem of one config is collected and raised together in one ConfigError. Steps:
1. Raw pass (keys.py): unknown keys at any depth are errors naming the dotted path and the closest valid key
   (`strict: false`, or resolve(strict=False), which wins, turns each into one ConfigWarning and drops it).
2. pydantic schema (schema/): strict types (the string "8" is not an integer; 5e8 is accepted for an integer),
   DeepSpeed defaults, aliases (`stage3_*`, `bfloat16`), legacy forms (`"zero_optimization": true` is stage 1,
   `cpu_offload`).
3. Cross-field rules: the batch triple, fp16 with bf16, offload per stage, optimizer and scheduler names.

HF-style "auto" (Transformers' Trainer fills these in before DeepSpeed sees the config):
- train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps: an "auto" member is treated
  as missing and derived from the others by DeepSpeed's rules; when it cannot be derived, the error names it.
- zero_optimization.reduce_bucket_size = hidden_size**2; stage3_prefetch_bucket_size (or prefetch_bucket_size)
  = int(0.9 * hidden_size**2); stage3_param_persistence_threshold (or param_persistence_threshold)
  = 10 * hidden_size, when resolve() got hidden_size; otherwise an error naming the key.
- Keys where "auto" is a real DeepSpeed value stay as given: pipeline.stages, zero_optimization.zenflow.
  select_strategy / select_interval / update_interval. Free-form sections (sparse_attention,
  compression_training, extra keys of amp/autotuning/...) are passed through untouched.
- Any other "auto" (optimizer.params.lr, scheduler.params.*, gradient_clipping, fp16.enabled, bf16.enabled,
  ...) is an error naming the dotted key: it must be filled in by the caller or replaced with a value. It
  never silently becomes a default (DeepSpeed drops it to the default inside sections; we do not).
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any

from pydantic import ValidationError

from slipstream.config.batch import apply_elasticity, batch_plan, mark_elastic
from slipstream.config.errors import ConfigError, ConfigWarning, pydantic_problems
from slipstream.config.keys import BATCH_KEYS, KeyWalk, unimplemented_keys
from slipstream.config.optimizers import DEEPSPEED_ONLY, REGISTRY, spec_for
from slipstream.config.plan import (
    ActivationCheckpointPlan,
    AioPlan,
    BatchPlan,
    CheckpointPlan,
    CometPlan,
    CommsLogPlan,
    CpuTarget,
    EnginePlan,
    FlopsProfilePlan,
    LoggingPlan,
    LossScalePlan,
    MonitorPlan,
    NoOffloadTarget,
    NvmeTarget,
    OffloadTarget,
    OptimizerPlan,
    ParallelPlan,
    PipelinePlan,
    PrecisionPlan,
    SchedulerPlan,
    Stage3Plan,
    WandbPlan,
    ZenFlowPlan,
    ZeroPlan,
)
from slipstream.config.schema.misc import ActivationCheckpointingConfig
from slipstream.config.schema.top import DeepSpeedConfig
from slipstream.config.schema.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = ["collective_timeout_of", "default_stage3_plan", "resolve", "resolve_zero_init"]
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
_TBS, _MICRO, _GAS = BATCH_KEYS


def resolve(
    config: dict[str, Any],
    *,
    world_size: int,
    strict: bool | None = None,
    hidden_size: int | None = None,
) -> EnginePlan:
    """Validate `config` for a data-parallel `world_size` and return the frozen plans.

    strict None means the config's own top-level "strict" key (default true); the argument wins when given.
    hidden_size feeds the "auto" bucket sizes of zero_optimization. Raises ConfigError listing every problem.
    """
    if not isinstance(config, dict):
        raise ConfigError([f"config: expected a dict (see load_config), got {type(config).__name__}"])
    problems = _argument_problems(world_size, hidden_size)
    own_strict = config.get("strict", True)
    walk = KeyWalk(
        strict=strict if strict is not None else own_strict is not False,
        hidden_size=hidden_size if isinstance(hidden_size, int) and hidden_size > 0 else None,
    )
    cleaned = walk.clean(config, DeepSpeedConfig)
    if strict is not None:
        cleaned["strict"] = strict
    problems += walk.problems
    cfg, bad_sections = _validate(cleaned, problems)
    ws_ok = not problems or not problems[0].startswith("world_size")
    batch = None
    parallel = _parallel_plan(cfg, world_size if ws_ok else 1, problems)
    data_world = world_size // (parallel.tp_size * parallel.sp_size) if ws_ok else world_size
    if ws_ok and data_world and not bad_sections.intersection(BATCH_KEYS):
        elastic = apply_elasticity(cfg, data_world, problems)
        if elastic is not None:
            cfg = elastic
            batch = batch_plan(cfg, data_world, walk.auto_batch, problems)
            batch = batch and mark_elastic(batch, cfg)
    precision = _precision_plan(cfg, problems)
    aio = _aio_plan(cfg)
    zero = _zero_plan(cfg, aio, problems)
    optimizer, unimplemented = _optimizer_plan(cfg, problems), unimplemented_keys(cfg)
    scheduler = _scheduler_plan(cfg, problems)
    if problems or batch is None:
        raise ConfigError(problems)
    if optimizer is not None and optimizer.name.lower() in DEEPSPEED_ONLY:
        unimplemented.append(f"optimizer.type={optimizer.name}")
    return EnginePlan(
        batch=batch,
        precision=precision,
        zero=zero,
        optimizer=optimizer,
        scheduler=scheduler,
        gradient_clipping=cfg.gradient_clipping,
        logging=_logging_plan(cfg),
        dataloader_drop_last=cfg.dataloader_drop_last,
        checkpoint=CheckpointPlan(
            tag_validation=cfg.checkpoint.tag_validation, load_universal=cfg.checkpoint.load_universal
        ),
        pipeline=PipelinePlan(activation_checkpoint_interval=cfg.pipeline.activation_checkpoint_interval),
        collective_timeout=cfg.collective_timeout,
        parallel=parallel,
        activation_checkpointing=_activation_plan(cfg.activation_checkpointing)
        if "activation_checkpointing" in cfg.model_fields_set
        else None,
        unimplemented=tuple(dict.fromkeys(unimplemented)),
        resolved=_resolved(cfg, batch),
    )


def _parallel_plan(cfg: DeepSpeedConfig, world_size: int, problems: list[str]) -> ParallelPlan:
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


def _validate(cleaned: dict[str, Any], problems: list[str]) -> tuple[DeepSpeedConfig, set[str]]:
    """The validated config. When some sections fail, their problems are recorded and the rest is validated
    again without them, so cross-field rules still report their problems in the same ConfigError."""
    try:
        return DeepSpeedConfig.model_validate(cleaned), set()
    except ValidationError as exc:
        problems += pydantic_problems(exc)
        bad = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
    try:
        return DeepSpeedConfig.model_validate({k: v for k, v in cleaned.items() if k not in bad}), bad
    except ValidationError:
        raise ConfigError(problems) from None


def _argument_problems(world_size: Any, hidden_size: Any) -> list[str]:
    problems = []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        problems.append(f"world_size: expected an integer >= 1 (the data-parallel size), got {world_size!r}")
    if hidden_size is not None and (
        isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1
    ):
        problems.append(f"hidden_size: expected an integer >= 1 (the model's hidden size), got {hidden_size!r}")
    return problems


def _param_dtype(cfg: DeepSpeedConfig) -> str:
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def _precision_plan(cfg: DeepSpeedConfig, problems: list[str]) -> PrecisionPlan:
    fp16, bf16, accum = cfg.fp16, cfg.bf16, cfg.data_types.grad_accum_dtype
    if fp16.enabled and bf16.enabled:
        problems.append("fp16.enabled, bf16.enabled: both are true; enable at most one of fp16 and bf16")
    scale = None
    if fp16.enabled:
        scale = LossScalePlan(
            static_scale=fp16.loss_scale if fp16.loss_scale > 0 else None,
            initial_scale_power=fp16.initial_scale_power,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=fp16.min_loss_scale,
        )
    param_dtype = _param_dtype(cfg)
    return PrecisionPlan(
        param_dtype=param_dtype,
        grad_accum_dtype=accum or "fp32",
        master_dtype="fp32",
        loss_scale=scale,
        check_grad_overflow={"fp16": True, "bf16": bf16.check_grad_overflow, "fp32": False}[param_dtype],
        max_consecutive_skips=cfg.max_consecutive_skipped_steps,
    )


def _aio_plan(cfg: DeepSpeedConfig) -> AioPlan:
    aio = cfg.aio
    return AioPlan(
        block_size=aio.block_size,
        queue_depth=aio.queue_depth,
        intra_op_parallelism=aio.intra_op_parallelism,
        single_submit=aio.single_submit,
        overlap_events=aio.overlap_events,
    )


def _offload_target(section: OffloadOptimizerConfig | OffloadParamConfig | None, aio: AioPlan) -> OffloadTarget:
    """The one place an offload section's `device` string becomes a type."""
    if section is None or section.device == "none":
        return NoOffloadTarget()
    if section.device == "nvme":
        return NvmeTarget(pin_memory=section.pin_memory, path=str(section.nvme_path or ""), aio=aio)
    return CpuTarget(pin_memory=section.pin_memory)


def _zero_plan(cfg: DeepSpeedConfig, aio: AioPlan, problems: list[str]) -> ZeroPlan:
    zero, prefix = cfg.zero_optimization, "zero_optimization"
    offload = _offload_target(zero.offload_optimizer, aio)
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
    param_off = _offload_target(zero.offload_param, aio)
    if param_off.on_host and zero.stage != 3:
        warnings.warn(
            f"{prefix}.offload_param has no effect below stage 3 (stage is {zero.stage})",
            ConfigWarning,
            stacklevel=3,
        )
    stage3 = None
    if zero.stage == 3:
        stage3 = _stage3_plan(zero, param_off)
        problems += _param_offload_problems(stage3.offload_param, offload, prefix)
    return ZeroPlan(
        stage=zero.stage,
        reduce_bucket_size=zero.reduce_bucket_size,
        offload_optimizer=offload,
        stage3=stage3,
        force_host_optimizer=cfg.zero_force_ds_cpu_optimizer,
        allow_untested_optimizer=cfg.zero_allow_untested_optimizer,
        zenflow=_zenflow_plan(zero, offload, problems),
    )


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


def _stage3_plan(zero: ZeroConfig, offload_param: OffloadTarget) -> Stage3Plan:
    """DeepSpeed's stage3_* names become the components' names here, and nowhere else."""
    leaf = zero.leaf_module
    return Stage3Plan(
        prefetch_numel=zero.prefetch_bucket_size,
        persistence_threshold=zero.param_persistence_threshold,
        max_live_numel=zero.max_live_parameters,
        reuse_distance=zero.max_reuse_distance,
        gather_16bit_on_save=zero.gather_16bit_weights_on_model_save,
        offload_param=offload_param,
        leaf_classes=tuple(leaf.classes),
        leaf_names=tuple(leaf.names),
        leaf_suffixes=tuple(leaf.name_suffixes),
        sub_group_numel=zero.sub_group_size or 1_000_000_000,
    )


def default_stage3_plan(**changes: Any) -> Stage3Plan:
    """The stage-3 plan of a config that sets nothing (the schema's defaults), with `changes` applied."""
    import dataclasses

    return dataclasses.replace(_stage3_plan(ZeroConfig(), NoOffloadTarget()), **changes)


def resolve_zero_init(config: dict[str, Any], *, remote_device: str | None = None) -> tuple[Stage3Plan, str]:
    """(stage-3 plan, parameter dtype) for zero.Init from a DeepSpeed config dict, before initialize().
    `remote_device` ("cpu", "nvme" or "none"; zero.Init's argument) overrides offload_param.device.

    Reads the same sections through the same schema as resolve(), leniently: zero.Init runs before the
    engine, whose resolve() reports every problem of the config; here a section that does not validate
    falls back to the defaults.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        walk = KeyWalk(strict=False, hidden_size=None)
        cleaned = walk.clean(config, DeepSpeedConfig)
        cfg, _bad = _validate(cleaned, [])
    zero = cfg.zero_optimization
    section = zero.offload_param or OffloadParamConfig()
    if remote_device is not None:
        if remote_device not in ("none", "cpu", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected 'none', 'cpu' or 'nvme'")
        section = section.model_copy(update={"device": remote_device})
    stage3 = _stage3_plan(zero, _offload_target(section, _aio_plan(cfg)))
    return stage3, _param_dtype(cfg)


def _optimizer_plan(cfg: DeepSpeedConfig, problems: list[str]) -> OptimizerPlan | None:
    """DeepSpeed's `_configure_basic_optimizer` naming over the registry (config/optimizers.py): its names
    lower-cased, torch.optim names as given; DeepSpeed's defaults filled in."""
    if cfg.optimizer is None:
        return None
    given, params = cfg.optimizer.type, dict(cfg.optimizer.params)
    if "max_grad_norm" in params:
        problems.append(
            "optimizer.params.max_grad_norm: not supported; use the top-level "
            f'"gradient_clipping": {params["max_grad_norm"]!r} instead'
        )
    lower = given.lower()
    spec = spec_for(given)
    if lower in DEEPSPEED_ONLY:
        return OptimizerPlan(name=lower, params=params)
    if spec is None and _torch_class("optim", given):
        return OptimizerPlan(name=given, params=params)
    if spec is None:
        names = [*(n for n in REGISTRY if n.islower()), *DEEPSPEED_ONLY]
        close = difflib.get_close_matches(lower, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        problems.append(
            f"optimizer.type: unknown optimizer {given!r}; {hint}use a DeepSpeed name (adam, adamw, "
            "lamb, lion, adagrad, ...) or a torch.optim class name such as 'SGD' (case-sensitive)"
        )
        return None
    name = spec.name
    torch_defaults = False
    if name in ("adam", "adamw"):
        torch_defaults = params.pop("torch_adam", False)
        adam_w_mode = params.pop("adam_w_mode", True)
        for key, value in (("torch_adam", torch_defaults), ("adam_w_mode", adam_w_mode)):
            if not isinstance(value, bool):
                problems.append(f"optimizer.params.{key}: expected a boolean (true or false), got {value!r}")
        name = "adamw" if name == "adamw" or adam_w_mode is not False else "adam"
        spec = REGISTRY[name]
    # [Note: optimizer defaults] in config/optimizers.py
    defaults = {} if torch_defaults is True else dict(spec.defaults)
    if torch_defaults is True:  # the engine builds torch.optim's Adam/AdamW instead of FusedAdam
        params["torch_adam"] = True
    return OptimizerPlan(name=name, params={**defaults, **params})


def _torch_class(module: str, name: str) -> bool:
    import torch.optim
    import torch.optim.lr_scheduler

    found = getattr(torch.optim if module == "optim" else torch.optim.lr_scheduler, name, None)
    return isinstance(found, type)


def _scheduler_plan(cfg: DeepSpeedConfig, problems: list[str]) -> SchedulerPlan | None:
    if cfg.scheduler is None:
        return None
    name = cfg.scheduler.type
    if name not in DEEPSPEED_SCHEDULERS and not _torch_class("lr_scheduler", name):
        close = difflib.get_close_matches(name, DEEPSPEED_SCHEDULERS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        problems.append(
            f"scheduler.type: unknown scheduler {name!r}; {hint}use one of "
            f"{', '.join(DEEPSPEED_SCHEDULERS)} or a torch.optim.lr_scheduler class name"
        )
        return None
    return SchedulerPlan(name=name, params=dict(cfg.scheduler.params))


def _activation_plan(section: ActivationCheckpointingConfig) -> ActivationCheckpointPlan:
    return ActivationCheckpointPlan(
        partition_activations=section.partition_activations,
        cpu_checkpointing=section.cpu_checkpointing,
        synchronize=section.synchronize_checkpoint_boundary,
        profile=section.profile,
    )


def activation_checkpoint_plan(section: dict[str, Any]) -> ActivationCheckpointPlan:
    """The plan of a raw `activation_checkpointing` section alone (slipstream.checkpointing.configure's
    `deepspeed_config`); a bad key raises ConfigError as a whole config would."""
    try:
        return _activation_plan(ActivationCheckpointingConfig.model_validate(section))
    except ValidationError as exc:
        raise ConfigError(pydantic_problems(exc, prefix=("activation_checkpointing",))) from None


def _same_named(section: Any, plan_class: Any, **converted: Any) -> Any:
    """`plan_class` filled from the schema section's fields of the same names (`converted` where a value
    changes type): for plan classes that mirror a DeepSpeed section one to one."""
    names = [field.name for field in dataclasses.fields(plan_class)]
    return plan_class(**{name: getattr(section, name) for name in names if name not in converted}, **converted)


def _logging_plan(cfg: DeepSpeedConfig) -> LoggingPlan:
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


def _resolved(cfg: DeepSpeedConfig, batch: BatchPlan) -> dict[str, Any]:
    data = cfg.model_dump(mode="json", by_alias=True)
    data[_TBS], data[_MICRO], data[_GAS] = (
        batch.train_batch_size,
        batch.micro_batch_size,
        batch.gradient_accumulation_steps,
    )
    zero = cfg.zero_optimization
    data["zero_optimization"]["overlap_comm"] = zero.overlap_comm if zero.overlap_comm is not None else zero.stage == 3
    return data


def collective_timeout_of(raw: dict[str, Any]) -> float | None:
    """The config's `collective_timeout` ahead of resolve(), which needs the world size and so the process group,
    which should be created with this timeout. A value resolve() rejects is left for resolve() to report."""
    value = raw.get("collective_timeout")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return float(value)
