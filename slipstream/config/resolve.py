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

import difflib
import warnings
from typing import Any, Optional

from pydantic import ValidationError

from slipstream.config.batch import batch_plan
from slipstream.config.errors import ConfigError, ConfigWarning, pydantic_problems
from slipstream.config.keys import BATCH_KEYS, KeyWalk, unimplemented_keys
from slipstream.config.plan import (
    BatchPlan,
    EnginePlan,
    LoggingPlan,
    LossScalePlan,
    MonitorPlan,
    OffloadOptimizerPlan,
    OptimizerPlan,
    PrecisionPlan,
    SchedulerPlan,
    Stage3Plan,
    AioPlan,
    ZeroPlan,
)
from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["resolve"]

DEEPSPEED_OPTIMIZERS = (
    "adagrad",
    "adam",
    "adamw",
    "lamb",
    "onebitadam",
    "onebitlamb",
    "zerooneadam",
    "lion",
    "muadam",
    "muadamw",
    "musgd",
    "muon",
)
IMPLEMENTED_OPTIMIZERS = ("adam", "adamw", "adagrad", "lamb", "lion", "sgd")
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
_TBS, _MICRO, _GAS = BATCH_KEYS


def resolve(
    config: dict[str, Any],
    *,
    world_size: int,
    strict: Optional[bool] = None,
    hidden_size: Optional[int] = None,
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
    if ws_ok and not bad_sections.intersection(BATCH_KEYS):
        batch = batch_plan(cfg, world_size, walk.auto_batch, problems)
    precision = _precision_plan(cfg, problems)
    zero = _zero_plan(cfg, problems)
    optimizer, unimplemented = _optimizer_plan(cfg, problems), unimplemented_keys(cfg)
    scheduler = _scheduler_plan(cfg, problems)
    if problems or batch is None:
        raise ConfigError(problems)
    unimplemented += _special_unimplemented(cfg, optimizer)
    return EnginePlan(
        batch=batch,
        precision=precision,
        zero=zero,
        optimizer=optimizer,
        scheduler=scheduler,
        gradient_clipping=cfg.gradient_clipping,
        logging=_logging_plan(cfg),
        dataloader_drop_last=cfg.dataloader_drop_last,
        gradient_predivide_factor=cfg.gradient_predivide_factor,
        prescale_gradients=cfg.prescale_gradients,
        aio=AioPlan(block_size=cfg.aio.block_size, queue_depth=cfg.aio.queue_depth,
                    intra_op_parallelism=cfg.aio.intra_op_parallelism, single_submit=cfg.aio.single_submit,
                    overlap_events=cfg.aio.overlap_events),
        collective_timeout=cfg.collective_timeout,
        unimplemented=tuple(dict.fromkeys(unimplemented)),
        resolved=_resolved(cfg, batch, zero),
    )


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
        problems.append(
            f"hidden_size: expected an integer >= 1 (the model's hidden size), got {hidden_size!r}"
        )
    return problems


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
    param_dtype = "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
    return PrecisionPlan(
        param_dtype=param_dtype,
        grad_accum_dtype=accum or "fp32",
        master_dtype="fp32",
        loss_scale=scale,
        check_grad_overflow={"fp16": True, "bf16": bf16.check_grad_overflow, "fp32": False}[param_dtype],
    )


def _zero_plan(cfg: DeepSpeedConfig, problems: list[str]) -> ZeroPlan:
    zero, prefix = cfg.zero_optimization, "zero_optimization"
    off = zero.offload_optimizer
    offload = None
    if off is not None and off.device != "none":
        offload = OffloadOptimizerPlan(
            device=off.device,
            nvme_path=off.nvme_path,
            pin_memory=off.pin_memory,
            buffer_count=off.buffer_count,
            ratio=off.ratio,
        )
        if off.device == "nvme" and not off.nvme_path:
            problems.append(
                f'{prefix}.offload_optimizer.nvme_path: required with device "nvme"; set a directory'
            )
        if off.ratio < 1.0 and zero.stage != 3:
            problems.append(
                f"{prefix}.offload_optimizer.ratio: {off.ratio} < 1 needs stage 3; set ratio to 1.0"
            )
        if zero.stage == 0:
            warnings.warn(
                f"{prefix}.offload_optimizer has no effect at stage 0; set {prefix}.stage to 1, 2 or 3",
                ConfigWarning,
                stacklevel=3,
            )
    param_off = zero.offload_param
    if param_off is not None and param_off.device != "none" and zero.stage != 3:
        warnings.warn(
            f"{prefix}.offload_param has no effect below stage 3 (stage is {zero.stage})",
            ConfigWarning,
            stacklevel=3,
        )
    stage3 = None
    if zero.stage == 3:
        stage3 = Stage3Plan(
            prefetch_bucket_size=zero.prefetch_bucket_size,
            param_persistence_threshold=zero.param_persistence_threshold,
            max_live_parameters=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            gather_16bit_weights_on_model_save=zero.gather_16bit_weights_on_model_save,
            offload_param=(
                param_off.model_dump(mode="json")
                if param_off is not None and param_off.device != "none"
                else None
            ),
            leaf_classes=tuple(str(c).rsplit(".", 1)[-1] for c in (zero.leaf_module or {}).get("classes", [])),
            leaf_names=tuple(str(n) for n in (zero.leaf_module or {}).get("names", [])),
        )
    return ZeroPlan(
        stage=zero.stage,
        reduce_bucket_size=zero.reduce_bucket_size,
        allgather_bucket_size=zero.allgather_bucket_size,
        overlap_comm=zero.overlap_comm if zero.overlap_comm is not None else zero.stage == 3,
        contiguous_gradients=zero.contiguous_gradients,
        reduce_scatter=zero.reduce_scatter,
        offload_optimizer=offload,
        stage3=stage3,
    )


def _optimizer_plan(cfg: DeepSpeedConfig, problems: list[str]) -> Optional[OptimizerPlan]:
    """DeepSpeed's `_configure_basic_optimizer` naming: its names lower-cased, torch.optim names as given."""
    if cfg.optimizer is None:
        return None
    given, params = cfg.optimizer.type, dict(cfg.optimizer.params)
    if "max_grad_norm" in params:
        problems.append(
            "optimizer.params.max_grad_norm: not supported; use the top-level "
            f'"gradient_clipping": {params["max_grad_norm"]!r} instead'
        )
    lower = given.lower()
    if lower in DEEPSPEED_OPTIMIZERS or lower == "sgd":
        name = lower
    elif _torch_class("optim", given):
        name = given
    else:
        close = difflib.get_close_matches(lower, [*DEEPSPEED_OPTIMIZERS, "sgd"], n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        problems.append(
            f"optimizer.type: unknown optimizer {given!r}; {hint}use a DeepSpeed name (adam, adamw, "
            "lamb, lion, adagrad, ...) or a torch.optim class name such as 'SGD' (case-sensitive)"
        )
        return None
    if name in ("adam", "adamw"):
        params.pop("torch_adam", None)
        adam_w_mode = params.pop("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            problems.append(
                f"optimizer.params.adam_w_mode: expected a boolean (true or false), got {adam_w_mode!r}"
            )
        name = "adamw" if name == "adamw" or adam_w_mode is not False else "adam"
    return OptimizerPlan(name=name, params=params)


def _torch_class(module: str, name: str) -> bool:
    import torch.optim
    import torch.optim.lr_scheduler

    found = getattr(torch.optim if module == "optim" else torch.optim.lr_scheduler, name, None)
    return isinstance(found, type)


def _scheduler_plan(cfg: DeepSpeedConfig, problems: list[str]) -> Optional[SchedulerPlan]:
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


def _special_unimplemented(cfg: DeepSpeedConfig, optimizer: Optional[OptimizerPlan]) -> list[str]:
    found = []
    zero = cfg.zero_optimization
    if (
        optimizer is not None
        and optimizer.name.lower() in DEEPSPEED_OPTIMIZERS
        and optimizer.name not in IMPLEMENTED_OPTIMIZERS
    ):
        found.append(f"optimizer.type={optimizer.name}")
    return found


def _logging_plan(cfg: DeepSpeedConfig) -> LoggingPlan:
    csv, board = cfg.csv_monitor, cfg.tensorboard
    monitor = MonitorPlan(
        csv_output_path=csv.output_path if csv.enabled else None,
        csv_job_name=csv.job_name,
        tensorboard_output_path=board.output_path if board.enabled else None,
        tensorboard_job_name=board.job_name,
    )
    return LoggingPlan(
        steps_per_print=cfg.steps_per_print, wall_clock_breakdown=cfg.wall_clock_breakdown, monitor=monitor
    )


def _resolved(cfg: DeepSpeedConfig, batch: BatchPlan, zero: ZeroPlan) -> dict[str, Any]:
    data = cfg.model_dump(mode="json", by_alias=True)
    data[_TBS], data[_MICRO], data[_GAS] = (
        batch.train_batch_size,
        batch.micro_batch_size,
        batch.gradient_accumulation_steps,
    )
    data["zero_optimization"]["overlap_comm"] = zero.overlap_comm
    return data
