"""`SchedulesPlan`: the per-step values the engine hands to the model's forward, resolved from the legacy
`curriculum_learning` section and `progressive_layer_drop` (slipstream/data/ builds them). `DataSamplingPlan`:
the curriculum sampler of `data_efficiency.data_sampling` (slipstream/data/curriculum_sampler.py).

DeepSpeed's rules kept here: a curriculum needs min_difficulty, max_difficulty and schedule_type, and each
schedule type its own schedule_config keys (fixed_discrete: one more difficulty than max_step). Only the
"seqlen" curriculum changes what the forward receives; any other curriculum_type is reported as not
implemented by name.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pydantic import ValidationError

from slipstream.config.errors import ConfigError, pydantic_problems
from slipstream.config.keys import unimplemented_keys
from slipstream.config.random_ltd_plan import RandomLTDPlan, random_ltd_plan
from slipstream.config.same_named import same_named
from slipstream.config.schema.data import (
    CurriculumLearningConfig,
    CurriculumMetricConfig,
    CurriculumScheduleConfig,
    DataEfficiencyConfig,
)

if TYPE_CHECKING:
    from slipstream.config.schema.top import DeepSpeedConfig

__all__ = [
    "CurriculumPlan",
    "DataSamplingPlan",
    "DynamicBatchingPlan",
    "LayerDropPlan",
    "MetricPlan",
    "SchedulesPlan",
    "data_sampling_plan",
    "schedule_plan",
    "sampling_plan_of",
    "schedules_plan",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CurriculumPlan:
    """A difficulty schedule (field docs: the schema's keys)."""

    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    """"fixed_linear" | "fixed_root" | "fixed_discrete" | "custom" (a function set at run time)."""
    total_step: int
    difficulty_step: int
    root_degree: int
    """1 for fixed_linear."""
    difficulties: tuple[int, ...]
    max_steps: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayerDropPlan:
    """The keep probability theta(t) = (1 - theta) * exp(-gamma * t) + theta."""

    theta: float
    gamma: float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SchedulesPlan:
    """What the engine adds to the forward's keyword arguments in training, and which samples the training loader
    draws per step; None: that schedule is off."""

    curriculum: CurriculumPlan | None
    """Hands `curriculum_seqlen` (the seqlen curriculum only)."""
    layer_drop: LayerDropPlan | None
    """Hands `progressive_layer_drop=True, pld_theta=...`."""
    sampling: DataSamplingPlan | None
    """The curriculum sampler of the training loader (data_efficiency.data_sampling); None: the plain loader."""
    random_ltd: RandomLTDPlan | None
    """The kept-token count of random-LTD's wrapped layers (data_efficiency.data_routing.random_ltd)."""
    dynamic_batching: DynamicBatchingPlan | None
    """The token packing and LR scaling of the variable-batch loader (data_sampling.dynamic_batching)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DynamicBatchingPlan:
    """Dynamic batching (field docs: DynamicBatchingConfig); data/dynamic_batching.py packs by it."""

    max_tokens: int
    lr_scaling_method: str
    min_batch_size: int
    max_batch_size: int | None
    order: str
    """sequence_picking_order: "dataloader" | "seqlen" | "random"."""
    metrics_path: str | None
    seed: int
    """data_efficiency.seed (the "random" order's shuffle)."""
    num_workers: int
    """data_sampling.num_workers: the loader's worker processes."""
    verbose: bool
    """Log each global batch's groups (rank 0) when the loader is built."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MetricPlan:
    """One curriculum metric of the sampler (field docs: CurriculumMetricConfig)."""

    name: str
    index_to_sample_path: str | None
    """None: single_cluster (the metric does not restrict the samples)."""
    index_to_metric_path: str | None
    """Read only for difficulty_type "value"."""
    difficulty_type: str
    """"value" | "percentile"."""
    schedule: CurriculumPlan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataSamplingPlan:
    """The curriculum sampler: the training loader draws each global batch from the eligible samples."""

    seed: int
    num_epochs: int
    num_workers: int
    metrics: tuple[MetricPlan, ...]


_LIMITS = ("min_difficulty", "max_difficulty", "schedule_type")
_NEEDS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),  # a function set at run time: set_custom_get_difficulty / set_custom_curriculum_learning_schedule
}


def schedules_plan(cfg: DeepSpeedConfig, problems: list[str], unimplemented: list[str]) -> SchedulesPlan:
    """The schedules; a missing key is a problem naming it, a curriculum other than seqlen is reported."""
    curriculum, layer_drop = cfg.curriculum_learning, cfg.progressive_layer_drop
    drop = LayerDropPlan(theta=layer_drop.theta, gamma=layer_drop.gamma) if layer_drop.enabled else None
    plan = None
    if curriculum.enabled:
        plan = _curriculum_plan(curriculum, problems)
        if curriculum.curriculum_type != "seqlen":
            unimplemented.append(f"curriculum_learning.curriculum_type={curriculum.curriculum_type}")
            plan = None
    sampling = data_sampling_plan(cfg.data_efficiency, problems, unimplemented)
    return SchedulesPlan(
        curriculum=plan,
        layer_drop=drop,
        sampling=sampling,
        random_ltd=random_ltd_plan(cfg, problems),
        dynamic_batching=dynamic_batching_plan(cfg.data_efficiency, problems),
    )


def dynamic_batching_plan(efficiency: DataEfficiencyConfig, problems: list[str]) -> DynamicBatchingPlan | None:
    """The section when its `enabled` is on (DeepSpeed reads it whatever the switches above it say)."""
    section = efficiency.data_sampling.dynamic_batching
    if not section.enabled:
        return None
    where = f"{_SAMPLING}.dynamic_batching"
    if section.max_tokens is None or section.max_tokens < 1:
        problems.append(f"{where} is enabled but max_tokens is {section.max_tokens}; set it to an integer >= 1")
        return None
    if section.max_batch_size is not None and section.max_batch_size < max(section.min_batch_size, 1):
        problems.append(
            f"{where}: max_batch_size {section.max_batch_size} is below min_batch_size {section.min_batch_size}; "
            "raise max_batch_size or leave it out"
        )
        return None
    return same_named(
        section,
        DynamicBatchingPlan,
        order=section.sequence_picking_order,
        seed=efficiency.seed,
        num_workers=efficiency.data_sampling.num_workers,
    )


def _curriculum_plan(section: CurriculumLearningConfig, problems: list[str]) -> CurriculumPlan | None:
    where = "curriculum_learning"
    if section.curriculum_type is None:
        problems.append(f"{where} is enabled but {where}.curriculum_type is not set; set it (DeepSpeed requires it)")
        return None
    limits = (section.min_difficulty, section.max_difficulty, section.schedule_type)
    return schedule_plan(where, limits, section.schedule_config, problems)


def schedule_plan(
    where: str,
    limits: tuple[int | None, int | None, str | None],
    schedule: CurriculumScheduleConfig,
    problems: list[str],
) -> CurriculumPlan | None:
    """The schedule at `where` from its (min_difficulty, max_difficulty, schedule_type) and schedule_config; a
    missing or inconsistent key is a problem naming it (then None)."""
    low, high, kind = limits
    missing = [f"{where}.{key}" for key, value in zip(_LIMITS, limits) if value is None]
    if kind is not None:
        missing += [f"{where}.schedule_config.{key}" for key in _NEEDS[kind] if getattr(schedule, key) is None]
    if missing or kind is None or low is None or high is None:
        problems.append(f"{where} is enabled but {', '.join(missing)} is not set; set it (DeepSpeed requires it)")
        return None
    difficulties, max_steps = tuple(schedule.difficulty or ()), tuple(schedule.max_step or ())
    if kind == "fixed_discrete" and (not max_steps or len(difficulties) != len(max_steps) + 1):
        problems.append(
            f"{where}.schedule_config: difficulty {list(difficulties)} needs exactly one more entry than max_step "
            f"{list(max_steps)} (the last difficulty holds for every later step); fix the two lists"
        )
        return None
    for key in ("difficulty_step", "total_curriculum_step"):
        value = getattr(schedule, key)
        if value is not None and value < 1:
            problems.append(f"{where}.schedule_config.{key}: expected an integer >= 1, got {value}")
            return None
    step = schedule.difficulty_step
    return CurriculumPlan(
        min_difficulty=low,
        max_difficulty=high,
        schedule_type=kind,
        total_step=schedule.total_curriculum_step or 0,
        difficulty_step=step or 1,
        root_degree=1 if kind == "fixed_linear" else schedule.root_degree or 1,
        difficulties=difficulties,
        max_steps=max_steps,
    )


_SAMPLING = "data_efficiency.data_sampling"
_CURRICULUM = f"{_SAMPLING}.curriculum_learning"


def data_sampling_plan(
    efficiency: DataEfficiencyConfig, problems: list[str], unimplemented: list[str]
) -> DataSamplingPlan | None:
    """The sampler when data_efficiency, its data_sampling and their curriculum_learning are all enabled (the
    curriculum alone, with a switch above it off, is reported: the loader stays the plain one)."""
    sampling = efficiency.data_sampling
    if not sampling.curriculum_learning.enabled:
        return None
    if not (efficiency.enabled and sampling.enabled):
        off = "data_efficiency.enabled" if not efficiency.enabled else f"{_SAMPLING}.enabled"
        unimplemented.append(f"{_CURRICULUM}.enabled (ignored: {off} is false; set it true for the sampler)")
        return None
    metrics = []
    for name, entry in sampling.curriculum_learning.curriculum_metrics.items():
        metric = _metric_plan(name, entry, problems, unimplemented)
        if metric is not None:
            metrics.append(metric)
    if not sampling.curriculum_learning.curriculum_metrics:
        problems.append(f"{_CURRICULUM} is enabled but curriculum_metrics is empty; name at least one metric")
    if sampling.num_epochs < 1:
        problems.append(f"{_SAMPLING}.num_epochs: expected an integer >= 1, got {sampling.num_epochs}")
    if len(metrics) != len(sampling.curriculum_learning.curriculum_metrics) or sampling.num_epochs < 1:
        return None
    return DataSamplingPlan(
        seed=efficiency.seed, num_epochs=sampling.num_epochs, num_workers=sampling.num_workers, metrics=tuple(metrics)
    )


def sampling_plan_of(section: dict[str, object]) -> DataSamplingPlan:
    """The sampler plan of a `data_efficiency` section given alone (DeepSpeed's sampler takes the section
    dict); ConfigError naming what is missing or wrong."""
    try:
        efficiency = DataEfficiencyConfig.model_validate(section)
    except ValidationError as exc:
        raise ConfigError(pydantic_problems(exc, ["data_efficiency"])) from None
    problems: list[str] = []
    plan = data_sampling_plan(efficiency, problems, [])
    if plan is None and not problems:
        problems.append(
            f"{_CURRICULUM}: the curriculum sampler needs data_efficiency.enabled, {_SAMPLING}.enabled "
            "and curriculum_learning.enabled all true"
        )
    if problems or plan is None:
        raise ConfigError(problems)
    return plan


def _metric_plan(
    name: str, entry: dict[str, object], problems: list[str], unimplemented: list[str]
) -> MetricPlan | None:
    where = f"{_CURRICULUM}.curriculum_metrics.{name}"
    try:
        metric = CurriculumMetricConfig.model_validate(entry)
    except ValidationError as exc:
        problems.extend(pydantic_problems(exc, where.split(".")))
        return None
    unimplemented.extend(unimplemented_keys(metric, where))
    if metric.difficulty_type is None or metric.clustering_type is None:
        problems.append(
            f"{where}: set difficulty_type (value|percentile) and clustering_type (schedule_based|"
            "single_cluster); DeepSpeed requires both"
        )
        return None
    sample_path = None if metric.clustering_type == "single_cluster" else metric.index_to_sample_path
    needs = [
        key
        for key, wanted in (
            ("index_to_sample_path", metric.clustering_type != "single_cluster"),
            ("index_to_metric_path", sample_path is not None and metric.difficulty_type == "value"),
        )
        if wanted and getattr(metric, key) is None
    ]
    if needs:
        problems.append(
            f"{where}: {' and '.join(needs)} not set; give the metric index's path prefix (the files "
            "the data analyzer writes)"
        )
        return None
    limits = (metric.min_difficulty, metric.max_difficulty, metric.schedule_type)
    schedule = schedule_plan(where, limits, metric.schedule_config, problems)
    if schedule is None:
        return None
    return MetricPlan(
        name=name,
        index_to_sample_path=sample_path,
        index_to_metric_path=metric.index_to_metric_path,
        difficulty_type=metric.difficulty_type,
        schedule=schedule,
    )
