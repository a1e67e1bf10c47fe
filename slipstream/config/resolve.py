"""Turns a DeepSpeed config dict into an EnginePlan: validation, DeepSpeed's defaults, cross-field rules.

Every problem of one config is collected and raised together in one ConfigError. Steps:
1. Raw pass (keys.py): unknown keys at any depth are errors naming the dotted path and the closest valid key
   (`strict: false`, or resolve(strict=False), which wins, turns each into one ConfigWarning and drops it).
2. pydantic schema (schema/): strict types (the string "8" is not an integer; 5e8 is accepted for an integer),
   DeepSpeed defaults, aliases (`stage3_*`, `bfloat16`), legacy forms (`"zero_optimization": true` is stage 1,
   `cpu_offload`).
3. Cross-field rules and plans, one module per part: the world split and the batch triple here (batch.py
   holds the rules), the ZeRO, offload and aio sections in zero_plans.py, optimizer and scheduler names in
   optimizer_plans.py, the other sections (parallelism, precision, logging, activation checkpointing,
   checkpoint, pipeline) in section_plans.py. Every plan field is filled from the schema; plans have no
   defaults of their own.

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

import warnings
from typing import Any

from pydantic import ValidationError

from slipstream.config.batch import apply_elasticity, batch_plan, mark_elastic
from slipstream.config.data_plans import schedules_plan
from slipstream.config.eigenvalue_plan import eigenvalue_plan
from slipstream.config.errors import ConfigError, pydantic_problems
from slipstream.config.inference_plans import hybrid_plan
from slipstream.config.keys import BATCH_KEYS, KeyWalk, unimplemented_keys
from slipstream.config.optimizer_plans import optimizer_plan, scheduler_plan
from slipstream.config.optimizers import DEEPSPEED_ONLY
from slipstream.config.plan import BatchPlan, CompilePlan, EnginePlan, ParallelPlan, Stage3Plan
from slipstream.config.schema.top import DeepSpeedConfig
from slipstream.config.schema.zero import OffloadParamConfig
from slipstream.config.section_plans import (
    activation_checkpoint_plan,
    activation_plan,
    autotuning_plan,
    checkpoint_plan,
    logging_plan,
    parallel_plan,
    param_dtype_of,
    pipeline_plan,
    precision_plan,
)
from slipstream.config.sparse_attention_plan import sparse_attention_plan
from slipstream.config.zero_plans import (
    aio_plan,
    default_stage3_plan,
    offload_target,
    stage3_plan,
    unhonoured_at_stage,
    zero_plan,
)

__all__ = [
    "activation_checkpoint_plan",
    "collective_timeout_of",
    "default_stage3_plan",
    "resolve",
    "resolve_zero_init",
]
_TBS, _MICRO, _GAS = BATCH_KEYS


def resolve(
    config: dict[str, object],
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
    cfg, batch, parallel = _batch_and_parallel(cfg, world_size, walk, bad_sections, problems)
    precision = precision_plan(cfg, problems)
    zero = zero_plan(cfg, aio_plan(cfg.aio), problems, grad_accum_dtype=precision.grad_accum_dtype)
    optimizer, unimplemented = optimizer_plan(cfg, problems), unimplemented_keys(cfg)
    scheduler, schedules = scheduler_plan(cfg, problems), schedules_plan(cfg, problems, unimplemented)
    sparse_plan = sparse_attention_plan(cfg.sparse_attention, problems)
    if problems or batch is None:
        raise ConfigError(problems)
    if optimizer is not None and optimizer.name.lower() in DEEPSPEED_ONLY:
        unimplemented.append(f"optimizer.type={optimizer.name}")
    unimplemented += unhonoured_at_stage(cfg.zero_optimization)
    return EnginePlan(
        batch=batch,
        precision=precision,
        zero=zero,
        optimizer=optimizer,
        scheduler=scheduler,
        gradient_clipping=cfg.gradient_clipping,
        logging=logging_plan(cfg),
        dataloader_drop_last=cfg.dataloader_drop_last,
        checkpoint=checkpoint_plan(cfg),
        pipeline=pipeline_plan(cfg),
        compile=CompilePlan(deepcompile=cfg.compile.deepcompile),
        autotuning=autotuning_plan(cfg),
        schedules=schedules,
        eigenvalue=eigenvalue_plan(cfg, unimplemented),  # before unimplemented= below: it may report
        compression_training=None if cfg.compression_training is None else cfg.compression_training.methods(),
        collective_timeout=cfg.collective_timeout,
        parallel=parallel,
        hybrid=hybrid_plan(cfg.hybrid_engine, parallel, world_size),
        activation_checkpointing=activation_plan(cfg),
        sparse_attention=sparse_plan,
        unimplemented=tuple(dict.fromkeys(unimplemented)),
        resolved=_resolved(cfg, batch),
    )


def _batch_and_parallel(
    cfg: DeepSpeedConfig, world_size: int, walk: KeyWalk, bad_sections: set[str], problems: list[str]
) -> tuple[DeepSpeedConfig, BatchPlan | None, ParallelPlan]:
    """The world split into TP x SP x data parallel, then the batch over the data-parallel ranks (elasticity,
    when enabled, replaces the config's batch keys first, so the config comes back too). The batch is None
    when the world size or a batch key is already reported as a problem."""
    ws_ok = not problems or not problems[0].startswith("world_size")
    batch = None
    parallel = parallel_plan(cfg, world_size if ws_ok else 1, problems)
    data_world = world_size // (parallel.tp_size * parallel.sp_size) if ws_ok else world_size
    if ws_ok and data_world and not bad_sections.intersection(BATCH_KEYS):
        elastic = apply_elasticity(cfg, data_world, problems)
        if elastic is not None:
            cfg = elastic
            batch = batch_plan(cfg, data_world, walk.auto_batch, problems)
            batch = batch and mark_elastic(batch, cfg)
    return cfg, batch, parallel


def _validate(cleaned: dict[str, object], problems: list[str]) -> tuple[DeepSpeedConfig, set[str]]:
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


def _argument_problems(world_size: object, hidden_size: object) -> list[str]:
    problems = []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        problems.append(f"world_size: expected an integer >= 1 (the data-parallel size), got {world_size!r}")
    if hidden_size is not None and (
        isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1
    ):
        problems.append(f"hidden_size: expected an integer >= 1 (the model's hidden size), got {hidden_size!r}")
    return problems


def resolve_zero_init(config: dict[str, object], *, remote_device: str | None = None) -> tuple[Stage3Plan, str]:
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
    stage3 = stage3_plan(zero, offload_target(section, aio_plan(cfg.aio)))
    return stage3, param_dtype_of(cfg)


def _resolved(cfg: DeepSpeedConfig, batch: BatchPlan) -> dict[str, Any]:
    data = cfg.model_dump(mode="json", by_alias=True)
    data[_TBS], data[_MICRO], data[_GAS] = (
        batch.train_batch_size,
        batch.micro_batch_size,
        batch.gradient_accumulation_steps,
    )
    return data


def collective_timeout_of(raw: dict[str, object]) -> float | None:
    """The config's `collective_timeout` ahead of resolve(), which needs the world size and so the process group,
    which should be created with this timeout. A value resolve() rejects is left for resolve() to report."""
    value = raw.get("collective_timeout")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return float(value)
