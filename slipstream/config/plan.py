"""The frozen plans that resolve.py produces from a DeepSpeed config.

Components take their own plan, never the whole config and never the engine (ARCHITECTURE.md, decision 4).
Dtypes are named "fp32" | "bf16" | "fp16"; DeepSpeed key spellings stay in schema/ and in
`EnginePlan.resolved`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "AioPlan",
    "BatchPlan",
    "EnginePlan",
    "LoggingPlan",
    "LossScalePlan",
    "MonitorPlan",
    "OffloadOptimizerPlan",
    "OptimizerPlan",
    "PrecisionPlan",
    "SchedulerPlan",
    "Stage3Plan",
    "ZeroPlan",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """train_batch_size == micro_batch_size * gradient_accumulation_steps * world_size."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    sources: dict[str, str]
    """Per field: "given", or "derived: <formula>" (e.g. "derived: 32 / (4 * 2)")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScalePlan:
    """fp16 loss scaling; static_scale None means dynamic scaling starting at 2**initial_scale_power."""

    static_scale: Optional[float]
    initial_scale_power: int
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPlan:
    """Dtypes of parameters, gradient accumulation and master weights; loss_scale only for fp16."""

    param_dtype: str
    grad_accum_dtype: str
    master_dtype: str
    loss_scale: Optional[LossScalePlan]
    check_grad_overflow: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerPlan:
    """Optimizer state kept off the accelerator ("cpu" or "nvme")."""

    device: str
    nvme_path: Optional[str]
    pin_memory: bool
    buffer_count: int
    ratio: float


@dataclass(frozen=True, kw_only=True, slots=True)
class AioPlan:
    """The `aio` section: how the async I/O op reads and writes NVMe files."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage3Plan:
    """Stage-3 parameter partitioning knobs (zero_optimization.stage3_*)."""

    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    gather_16bit_weights_on_model_save: bool
    offload_param: Optional[dict[str, Any]]
    """The offload_param section as plain data, or None when parameters stay on the device."""
    leaf_classes: tuple[str, ...] = ()
    """Class names whose modules are sharding units (zero_optimization.leaf_module.classes)."""
    leaf_names: tuple[str, ...] = ()
    """Qualified module names that are sharding units (zero_optimization.leaf_module.names)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroPlan:
    """ZeRO stage and its communication settings; overlap_comm is resolved (unset: true iff stage 3)."""

    stage: int
    reduce_bucket_size: int
    allgather_bucket_size: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_scatter: bool
    offload_optimizer: Optional[OffloadOptimizerPlan]
    stage3: Optional[Stage3Plan]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerPlan:
    """Canonical name ("adamw", "adam", "sgd", "adagrad", "lamb", "lion", or a torch.optim class name)
    and keyword arguments."""

    name: str
    params: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerPlan:
    """Scheduler class name (DeepSpeed lr_schedules or torch.optim.lr_scheduler) and kwargs."""

    name: str
    params: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorPlan:
    """Output paths of the enabled monitors; None means that monitor is disabled."""

    csv_output_path: Optional[str]
    csv_job_name: str
    tensorboard_output_path: Optional[str]
    tensorboard_job_name: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingPlan:
    """Progress logging and monitors."""

    steps_per_print: Optional[int]
    wall_clock_breakdown: bool
    monitor: MonitorPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class EnginePlan:
    """Everything the engine needs, resolved from one DeepSpeed config."""

    batch: BatchPlan
    precision: PrecisionPlan
    zero: ZeroPlan
    optimizer: Optional[OptimizerPlan]
    scheduler: Optional[SchedulerPlan]
    gradient_clipping: float
    logging: LoggingPlan
    dataloader_drop_last: bool
    gradient_predivide_factor: float
    prescale_gradients: bool
    aio: AioPlan
    collective_timeout: Optional[float]
    """Seconds before a collective that some rank never reached raises; None: the environment's default."""
    unimplemented: tuple[str, ...]
    """Dotted keys the user set that Slipstream accepts but does not implement yet (the engine warns once
    each)."""
    resolved: dict[str, Any]
    """The full resolved config as plain JSON data, defaults and "auto" filled in (what rank 0 logs)."""
