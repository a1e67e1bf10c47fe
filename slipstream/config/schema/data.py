"""Sections that shape what the model sees per step: the legacy `curriculum_learning` section (a sequence
length handed to the forward, growing on a schedule) and `progressive_layer_drop` (a keep probability handed
to the forward). Both are `OpenSection`s: DeepSpeed kept every key of them as given; the keys listed here are
type-checked and honoured, any other key is kept and reported as not implemented."""

from __future__ import annotations

from typing import Literal

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, OpenSection, plan_fields

__all__ = ["CurriculumLearningConfig", "CurriculumScheduleConfig", "ProgressiveLayerDropConfig"]


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
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete"] | None = None
    """How the difficulty grows with the step."""
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
