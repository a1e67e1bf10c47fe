"""The frozen plans that resolve.py produces from a DeepSpeed config.

Components take their own plan, never the whole config and never the engine (docs/design.md). Every knob a
component reads is a field here, defaulted once (in schema/) and translated from DeepSpeed's name once (in
resolve.py and the *_plans.py modules it calls). Plan fields have no defaults: resolve() fills every one. Dtypes
are named "fp32" | "bf16" | "fp16"; DeepSpeed key spellings stay in schema/, in `EnginePlan.resolved` (the
config as DeepSpeed clients read it back) and in compat/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from slipstream.config.autotuning_plan import AutotuningPlan
from slipstream.config.data_plans import SchedulesPlan
from slipstream.config.eigenvalue_plan import EigenvaluePlan
from slipstream.config.logging_plans import (
    CometPlan,
    CommsLogPlan,
    FlopsProfilePlan,
    LoggingPlan,
    MonitorPlan,
    WandbPlan,
)
from slipstream.config.precision_plans import AutocastPlan, Fp8Plan
from slipstream.config.sparse_attention_plan import SparseAttentionPlan

if TYPE_CHECKING:
    from slipstream.config.schema.zero import OffloadOptimizerConfig, OffloadParamConfig

__all__ = [
    "ActivationCheckpointPlan",
    "AioPlan",
    "AutotuningPlan",
    "BatchPlan",
    "CheckpointPlan",
    "CompilePlan",
    "CpuTarget",
    "EigenvaluePlan",
    "EnginePlan",
    "LoggingPlan",
    "LossScalePlan",
    "CometPlan",
    "CommsLogPlan",
    "FlopsProfilePlan",
    "MonitorPlan",
    "WandbPlan",
    "NoOffloadTarget",
    "NvmeTarget",
    "OFFLOAD_TARGETS",
    "OffloadTarget",
    "OptimizerPlan",
    "ParallelPlan",
    "PrecisionPlan",
    "SchedulerPlan",
    "SparseAttentionPlan",
    "Stage3Plan",
    "ZenFlowPlan",
    "ZeroPlan",
]


RESIDENT_GRAD_SUB_GROUPS = 2
"""ZeRO-3 with NVMe offload: sub-groups' gradient buffers kept in memory while backward adds into them (the step
reads two more at most: the one updated and the next); offload/grad_swap.py, and the planner's host figure."""

NVME_GRADIENTS_ENV = "SLIPSTREAM_NVME_GRADIENTS"
"""Where ZeRO-3's fp32 gradient shards live with NVMe optimizer offload: `files` (the default: per sub-group,
a few in memory; host memory bounded by a working set, 4 more bytes per parameter on the disk and in the step's
I/O) or `memory` (the whole shard in host memory: 4 bytes per parameter over the ranks, no gradient I/O; for a
model whose files the disk cannot hold, or a step that must not wait for the disk)."""


def nvme_gradients_in_files() -> bool:
    """`SLIPSTREAM_NVME_GRADIENTS` read (see `NVME_GRADIENTS_ENV`); an unknown value is an error naming both."""
    import os

    value = os.environ.get(NVME_GRADIENTS_ENV, "files").strip().lower()
    if value not in ("files", "memory"):
        raise ValueError(
            f"{NVME_GRADIENTS_ENV}={value!r}: use 'files' (gradient shards swapped per sub-group, the default) or "
            "'memory' (kept in host memory)"
        )
    return value == "files"


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

    static_scale: float | None
    initial_scale_power: int
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPlan:
    """Dtypes of parameters, gradients, masters and optimizer states; the forward's autocast; loss scaling."""

    param_dtype: str
    grad_accum_dtype: str
    master_dtype: str
    optimizer_state_dtype: str
    """The optimizer moments' dtype: fp32 unless `bf16.bf16_optimizer_states` (slipstream/precision/masters.py)."""
    master_rounding: str
    """How new values are stored in bf16 masters: "nearest", or "stochastic" (`bf16.stochastic_rounding`)."""
    autocast: AutocastPlan | None
    fp8: Fp8Plan | None
    buffer_dtype: str | None
    """The floating-point buffers' dtype (`data_types.buffer_dtype`; None: as placed); precision/buffers.py."""
    grad_predivide: float | None
    """Gradients are divided by this on arrival, before the reduction (None: the reduction group's size)."""
    loss_scale: LossScalePlan | None
    check_grad_overflow: bool
    max_consecutive_skips: int
    """Raise after this many consecutive steps skipped for non-finite gradients (0: never)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AioPlan:
    """The `aio` section: how the async I/O op reads and writes NVMe files."""

    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool


class OffloadTarget:
    """Where offloaded tensors live; this base class means nowhere (they stay on the accelerator).

    Decoded once from an `offload_optimizer` / `offload_param` section (`OFFLOAD_TARGETS` by `kind`, the
    section's `device`). Plain data: config/ may not import offload/, where each target's runtime policy lives
    (offload/choose.py `policy_for`); components read the policy, never the target's type.
    """

    __slots__ = ()
    kind: ClassVar[str] = "none"

    @classmethod
    def from_section(cls, section: OffloadOptimizerConfig | OffloadParamConfig, aio: AioPlan) -> OffloadTarget:
        """This target from an offload section whose `device` is `kind`."""
        return cls()

    @property
    def on_host(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True, slots=True)
class NoOffloadTarget(OffloadTarget):
    """Nothing is offloaded (`device: "none"`, or the section is absent)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuTarget(OffloadTarget):
    """Host memory (`device: "cpu"`), pinned when `pin_memory`."""

    kind: ClassVar[str] = "cpu"
    pin_memory: bool

    @classmethod
    def from_section(cls, section: OffloadOptimizerConfig | OffloadParamConfig, aio: AioPlan) -> OffloadTarget:
        return cls(pin_memory=section.pin_memory)

    @property
    def on_host(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmeTarget(CpuTarget):
    """Files under `path` (`device: "nvme"`), read and written through the async_io op with `aio`'s settings."""

    kind: ClassVar[str] = "nvme"
    path: str
    aio: AioPlan

    @classmethod
    def from_section(cls, section: OffloadOptimizerConfig | OffloadParamConfig, aio: AioPlan) -> OffloadTarget:
        return cls(pin_memory=section.pin_memory, path=str(section.nvme_path or ""), aio=aio)


OFFLOAD_TARGETS: tuple[type[OffloadTarget], ...] = (NoOffloadTarget, CpuTarget, NvmeTarget)
"""Every offload target, one per `device` value of an offload section."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LocoPlan:
    """LoCo's error feedback for qgZ (zero_optimization.zeropp_loco_param)."""

    err_beta: float
    """Weight of the kept error in its moving average, in [0, 1) (err_beta)."""
    reset_every: int
    """The kept errors go back to zero before every reset_every-th reduction of a unit (reset_T)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage3Plan:
    """Stage-3 parameter partitioning, in the components' names (zero_plans.py translates DeepSpeed's
    `zero_optimization.stage3_*` keys; `default_stage3_plan()` there gives the schema's defaults)."""

    prefetch_numel: int
    """Elements gathered ahead of use (stage3_prefetch_bucket_size)."""
    persistence_threshold: int
    """Parameters with at most this many elements are never sharded (stage3_param_persistence_threshold)."""
    max_live_numel: int
    """Gathered elements allowed at once before units are released (stage3_max_live_parameters)."""
    reuse_distance: int
    """A unit used again within this many elements stays gathered (stage3_max_reuse_distance)."""
    gather_16bit_on_save: bool
    """save_16bit_model gathers the whole model on rank 0 (stage3_gather_16bit_weights_on_model_save)."""
    offload_param: OffloadTarget
    """Where the parameter shards live."""
    leaf_classes: tuple[str, ...]
    """Classes (by name or package.module.Class) whose modules are leaves: gathered whole, never split
    (zero_optimization.leaf_module.classes)."""
    leaf_names: tuple[str, ...]
    """Qualified module names of leaves (zero_optimization.leaf_module.names)."""
    leaf_suffixes: tuple[str, ...]
    """Leaves by the end of their qualified names (zero_optimization.leaf_module.name_suffixes)."""
    quantized_weights: bool
    """The module hooks' all-gathers travel as block-wise int8 (zero_optimization.zero_quantized_weights)."""
    quantized_frozen_weights: bool
    """The same for units with no trainable parameter (zero_optimization.zero_quantized_nontrainable_weights)."""
    quantized_gradients: bool
    """Gradient reduce-scatters travel as int4 inside a node, int8 across (zero_optimization.zero_quantized_gradients)."""
    sub_group_numel: int
    """The optimizer steps (and NVMe offload swaps) masters, states and gradients this many elements at a time
    (zero_optimization.sub_group_size); a parameter larger than that is a sub-group of its own (so 0 makes every
    parameter one, as in DeepSpeed)."""
    secondary_shard_size: int
    """ZeRO++ hpZ: after a forward gather each unit keeps a secondary shard of its values over blocks of this many
    consecutive ranks, and the gathers until the next step read it there (zero_optimization.zero_hpz_partition_size;
    1: no secondary shard)."""
    shard_size: int | None
    """MiCS: units are sharded over blocks of this many consecutive ranks and replicated across the blocks
    (zero_optimization.mics_shard_size); None: sharded over the whole data-parallel group."""
    hierarchical_gather: bool
    """MiCS: a shard group spanning nodes gathers across nodes first, then inside each node
    (zero_optimization.mics_hierarchical_params_gather; zero/stage3/hierarchical_gather.py)."""
    loco: LocoPlan | None
    """ZeRO++ LoCo: qgZ's quantizations are error-compensated (zero_optimization.zeropp_loco_param, with
    zero_quantized_gradients; zero/stage3/loco.py); None: plain qgZ or no qgZ."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZenFlowPlan:
    """ZenFlow (zero_optimization.zenflow): selective column updates between offloaded CPU updates."""

    topk_ratio: float
    """Fraction of each 2-D weight's columns updated at every step (topk_ratio)."""
    select_every: int
    """Steps between column selections (select_interval), or epochs when `select_per_epoch`; 0: select once."""
    select_per_epoch: bool
    """`select_every` counts epochs of the engine's training data loader (select_strategy "epoch" / "auto")."""
    update_interval: int | None
    """Steps between CPU updates of the other columns; None for "auto" (refused by the ZeRO optimizer)."""
    full_warm_up_rounds: int
    """Ordinary full steps before the first selection."""
    overlap_step: bool
    """Run the CPU update in the background, one update interval behind (overlap_step)."""
    offload: bool
    """The selective optimizer's moments live in host buffers (offload)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroPlan:
    """ZeRO stage, its bucket size, optimizer offload and the optimizer checks."""

    stage: int
    reduce_bucket_size: int
    offload_optimizer: OffloadTarget
    stage3: Stage3Plan | None
    force_host_optimizer: bool
    """With optimizer offload, only an optimizer with a host kernel may run (zero_force_ds_cpu_optimizer)."""
    allow_untested_optimizer: bool
    """Per-tensor optimizers may run over flat shards (zero_allow_untested_optimizer)."""
    zenflow: ZenFlowPlan | None
    """ZenFlow (stages 1-2 with the optimizer offloaded to the CPU), or None."""
    overlap_comm: bool
    """Stages 1-3: a bucket's gradient reduction is launched during backward as it fills and stays in flight
    while backward goes on, waited for when its buffer is needed again or at the step
    (zero_optimization.overlap_comm); false waits at launch (stages 2, 3) or reduces at the step (stage 1)."""
    reduce_dtype: str
    """"fp32" | "fp16" | "bf16": the dtype gradients travel in when reduced across ranks, added back into the
    gradient accumulation dtype (communication_data_type; unset: the gradient accumulation dtype)."""
    sparse_gradients: bool
    """Stage 0: embedding gradients all-reduced as the rows they touch when that is smaller (sparse_gradients;
    zero/sparse_rows.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPlan:
    """The `checkpoint` section."""

    tag_validation: str
    """"IGNORE", "WARN" or "FAIL": what happens when ranks save under different tags."""
    load_universal: bool
    """`load_checkpoint(save_dir)` without a tag reads `latest_universal` instead of `latest`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """Model parallelism: tensor-parallel and sequence-parallel degrees (the data-parallel degree is the rest)."""

    tp_size: int
    """`tensor_parallel.autotp_size` (0 and 1 both mean no TP)."""
    tp_rules: tuple[tuple[str, str], ...]
    """`tensor_parallel.partition_config` layer specs, tried before the built-in rules: (regex on parameter
    names, "column" | "row" | "skip" | "gathered"). `use_default_specs: false` ends them with (".*", "skip")."""
    sp_size: int
    """`sequence_parallel_size`: Ulysses group size."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerPlan:
    """A registry name (config/optimizers.py) and keyword arguments, DeepSpeed's defaults filled in."""

    name: str
    params: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerPlan:
    """Scheduler class name (DeepSpeed lr_schedules or torch.optim.lr_scheduler) and kwargs."""

    name: str
    params: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointPlan:
    """The `activation_checkpointing` section (slipstream.checkpointing)."""

    partition_activations: bool
    cpu_checkpointing: bool
    contiguous_memory_optimization: bool
    number_checkpoints: int | None
    synchronize: bool
    profile: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class CompilePlan:
    """What `engine.compile()` takes from the `compile` section (slipstream/compile/)."""

    deepcompile: bool
    """DeepCompile was asked for: not built, so engine.compile() refuses it instead of compiling otherwise."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    """What the pipeline engine takes from the `pipeline` section (slipstream/pipe/engine.py)."""

    activation_checkpoint_interval: int
    """Layers per activation checkpoint; > 0 overrides the PipelineModule's own interval (as in DeepSpeed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridPlan:
    """`hybrid_engine` (engine/weight_handoff.py): `generate` (enabled: LoRA fused for generate, the ZeRO-3 model
    gathered once per call) and `pin_parameters` (False: at ZeRO-3 the hooks gather per layer, LoRA unfused)."""

    generate: bool
    pin_parameters: bool
    max_out_tokens: int
    """The longest prompt plus new tokens a hybrid `generate` takes (inference/limits.py)."""
    inference_tp_size: int
    """Ranks per tensor-parallel generation group (1: each rank generates alone; inference/hybrid_tp.py)."""
    tp_gather_partition_size: int
    """With inference_tp_size > 1 at ZeRO-3: units (layers) gathered at a time to refill the inference copy."""
    release_inference_cache: bool
    """With inference_tp_size > 1: the inference copy's memory freed after each generate (else kept)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EnginePlan:
    """Everything the engine needs, resolved from one DeepSpeed config."""

    batch: BatchPlan
    precision: PrecisionPlan
    zero: ZeroPlan
    optimizer: OptimizerPlan | None
    scheduler: SchedulerPlan | None
    gradient_clipping: float
    logging: LoggingPlan
    dataloader_drop_last: bool
    checkpoint: CheckpointPlan
    pipeline: PipelinePlan
    compile: CompilePlan
    collective_timeout: float | None
    """Seconds before a collective that some rank never reached raises; None: the environment's default."""
    activation_checkpointing: ActivationCheckpointPlan | None
    """The `activation_checkpointing` section when the config has one (the engine configures
    slipstream.checkpointing with it); None leaves that module's own configuration alone."""
    unimplemented: tuple[str, ...]
    """Dotted keys the user set that Slipstream accepts but does not implement yet (the engine warns once
    each)."""
    hybrid: HybridPlan
    """The `hybrid_engine` section (engine/weight_handoff.py)."""
    parallel: ParallelPlan
    """Tensor and sequence parallelism."""
    autotuning: AutotuningPlan
    schedules: SchedulesPlan
    eigenvalue: EigenvaluePlan | None
    """Block-Hessian eigenvalues to the monitors (profiling/eigenvalue.py); None: off."""
    sparse_attention: SparseAttentionPlan | None
    """The `sparse_attention` section completed with each mode's defaults (compat/ds_config.py hands it out)."""
    compression_training: dict[str, Any] | None
    """The `compression_training` methods as given (compression/plan.py reads them; engine/compression_steps.py)."""
    resolved: dict[str, Any]
    """The full resolved config as plain JSON data, defaults and "auto" filled in (what rank 0 logs)."""
