"""Sections that shape what the model sees per step: the legacy `curriculum_learning` section (a sequence
length handed to the forward, growing on a schedule) and `progressive_layer_drop` (a keep probability handed
to the forward). Both are `OpenSection`s: DeepSpeed kept every key of them as given; the keys listed here are
type-checked and honoured, any other key is kept and reported as not implemented. The `data_efficiency` section:
its curriculum sampler (`data_sampling.curriculum_learning`, slipstream/data/curriculum_sampler.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, DSModel, OpenSection, plan_fields
from slipstream.config.schema.data_routing import DataRoutingConfig

__all__ = [
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumScheduleConfig",
    "DataEfficiencyConfig",
    "ProgressiveLayerDropConfig",
]


class CurriculumScheduleConfig(OpenSection):
    """`curriculum_learning.schedule_config`: which keys a schedule reads depends on `schedule_type`."""

    IMPLEMENTED = plan_fields(
        "schedules.curriculum",
        "difficulty_step",
        "root_degree",
        total_curriculum_step="schedules.curriculum.total_step",
        difficulty="schedules.curriculum.difficulties",
        max_step="schedules.curriculum.max_steps",
    )

    total_curriculum_step: DSInt | None = None
    """fixed_linear / fixed_root: steps from min_difficulty to max_difficulty."""
    difficulty_step: DSInt | None = None
    """fixed_linear / fixed_root: every difficulty is a multiple of this (8 for fp16 tensor cores)."""
    root_degree: DSInt | None = None
    """fixed_root: 2 is a square-root schedule, 1 is linear."""
    difficulty: list[DSInt] | None = None
    """fixed_discrete: the difficulties, in order (one more than max_step)."""
    max_step: list[DSInt] | None = None
    """fixed_discrete: the last step of each difficulty but the last."""


class CurriculumLearningConfig(OpenSection):
    """`curriculum_learning` (legacy; DeepSpeed's data_efficiency section supersedes it)."""

    IMPLEMENTED = plan_fields(
        "schedules.curriculum",
        "min_difficulty",
        "max_difficulty",
        "schedule_type",
        enabled="schedules.curriculum",
        curriculum_type="schedules.curriculum",
    )

    enabled: DSBool = False
    """Hand `curriculum_seqlen` to the model's forward in training."""
    curriculum_type: str | None = None
    """What the difficulty is; "seqlen" (the only one the engine hands to the forward)."""
    min_difficulty: DSInt | None = None
    """The difficulty of the first step."""
    max_difficulty: DSInt | None = None
    """The difficulty the schedule ends at."""
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] | None = None
    """How the difficulty grows with the step ("custom": the function given at run time to
    engine.curriculum_scheduler_legacy.set_custom_get_difficulty)."""
    schedule_config: CurriculumScheduleConfig = CurriculumScheduleConfig()
    """The schedule's parameters."""


class ProgressiveLayerDropConfig(OpenSection):
    """`progressive_layer_drop`: the engine hands `progressive_layer_drop=True, pld_theta=<keep probability>`
    to the model's forward in training."""

    IMPLEMENTED = plan_fields("schedules.layer_drop", "theta", "gamma", enabled="schedules.layer_drop")

    enabled: DSBool = False
    """Hand the keep probability to the forward."""
    theta: DSFloat = 1.0
    """The keep probability the schedule decays towards."""
    gamma: DSFloat = 0.001
    """How fast it decays per step."""


class CurriculumMetricConfig(DSModel):
    """One entry of `data_efficiency.data_sampling.curriculum_learning.curriculum_metrics` (the entries are read
    by config/data_plans.py, so this table is not walked like a section: every key here is honoured)."""

    IMPLEMENTED = plan_fields(
        "data_sampling.metrics",
        "index_to_sample_path",
        "index_to_metric_path",
        "difficulty_type",
        "clustering_type",
        "min_difficulty",
        "max_difficulty",
        "schedule_type",
        "schedule_config",
    )

    index_to_sample_path: str | None = None
    """The metric index's `<metric>_index_to_sample` prefix (.bin/.idx): row i lists the samples of the i-th
    smallest value (or a `_percentile_merged` one); needed unless clustering_type is single_cluster."""
    index_to_metric_path: str | None = None
    """The `<metric>_index_to_metric` prefix: row i holds that value; needed when difficulty_type is value."""
    difficulty_type: Literal["value", "percentile"] | None = None
    """value: a sample is eligible while its metric <= the difficulty; percentile: while it is among the
    difficulty percent smallest."""
    clustering_type: Literal["schedule_based", "single_cluster"] | None = None
    """single_cluster: the metric does not restrict the samples (every sample is eligible)."""
    min_difficulty: DSInt | None = None
    """The difficulty of the first step."""
    max_difficulty: DSInt | None = None
    """The difficulty the schedule ends at (100 for percentile)."""
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] | None = None
    """How the difficulty grows with the step ("custom": the function set_custom_curriculum_learning_schedule
    gives for the metric)."""
    schedule_config: CurriculumScheduleConfig = CurriculumScheduleConfig()
    """The schedule's parameters (as the legacy section's)."""


class DataCurriculumConfig(OpenSection):
    """`data_efficiency.data_sampling.curriculum_learning`: difficulty-indexed sampling over metric indexes."""

    IMPLEMENTED = plan_fields(
        "schedules.sampling", enabled="schedules.sampling", curriculum_metrics="schedules.sampling.metrics"
    )

    enabled: DSBool = False
    """Draw each global batch from the samples eligible at the step's difficulties."""
    data_cluster_path: str | None = None
    """Where DeepSpeed writes its sample clusters; Slipstream keeps them in memory (and in checkpoints), so
    this key is reported."""
    curriculum_metrics: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Metric name -> its index, difficulty type and schedule (keys: CurriculumMetricConfig)."""


class DynamicBatchingConfig(OpenSection):
    """`data_efficiency.data_sampling.dynamic_batching`: samples packed into groups of at most max_tokens tokens,
    the learning rate scaled by each global batch's size (built by DeepSpeed's
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed; data/dynamic_batching.py)."""

    IMPLEMENTED = plan_fields(
        "schedules.dynamic_batching",
        "lr_scaling_method",
        "min_batch_size",
        "max_batch_size",
        "max_tokens",
        "metrics_path",
        "verbose",
        enabled="schedules.dynamic_batching",
        sequence_picking_order="schedules.dynamic_batching.order",
    )

    enabled: DSBool = False
    """Let the variable-batch loader and LR schedule be built from this section."""
    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    """How a global batch of n samples scales the learning rate given for train_batch_size samples."""
    min_batch_size: DSInt = 1
    """The fewest samples of a group; a group that cannot reach it ends the packing."""
    max_batch_size: DSInt | None = None
    """The most samples of a group (None: no limit)."""
    sequence_picking_order: Literal["random", "seqlen", "dataloader"] = "dataloader"
    """The order the samples are packed in: shuffled with data_efficiency.seed, by length, or dataset order."""
    max_tokens: DSInt | None = None
    """The most tokens (summed lengths) of a group; required when enabled."""
    metrics_path: str | None = None
    """The data analyzer's output folder: the lengths are read from seqlen/seqlen_sample_to_metric there
    unless given to the loader builder."""
    verbose: DSBool = False
    """Log each global batch's groups (their samples and token counts) when the loader is built."""


class DataSamplingConfig(OpenSection):
    """`data_efficiency.data_sampling`."""

    IMPLEMENTED = plan_fields("schedules.sampling", "num_epochs", "num_workers", enabled="schedules.sampling")

    enabled: DSBool = False
    """Turn data sampling on (the curriculum sampler needs it)."""
    num_epochs: DSInt = 1000
    """The sampler stops after this many epochs' worth of samples."""
    num_workers: DSInt = 0
    """DataLoader worker processes of the training loader."""
    pin_memory: DSBool = False
    """Reported (DeepSpeed's loader takes deepspeed_io's pin_memory argument instead)."""
    curriculum_learning: DataCurriculumConfig = DataCurriculumConfig()
    """Curriculum learning over user metrics."""
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    """Variable batch size by token count, and the learning rate scaled to it."""


class DataEfficiencyConfig(OpenSection):
    """`data_efficiency`: data sampling (the curriculum sampler) and data routing (random-LTD)."""

    IMPLEMENTED = plan_fields("schedules.sampling", "seed", enabled="schedules.sampling")

    enabled: DSBool = False
    """Turn the data efficiency library on (the curriculum sampler needs it)."""
    seed: DSInt = 1234
    """Seed of the sampler's shuffles."""
    data_sampling: DataSamplingConfig = DataSamplingConfig()
    """Data sampling."""
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)
    """Random layerwise token dropping (schema/data_routing.py)."""
