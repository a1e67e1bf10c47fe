"""`SchedulesPlan`: the per-step values the engine hands to the model's forward, resolved from the legacy
`curriculum_learning` section and `progressive_layer_drop` (slipstream/data/ builds them).

DeepSpeed's rules kept here: a curriculum needs min_difficulty, max_difficulty and schedule_type, and each
schedule type its own schedule_config keys (fixed_discrete: one more difficulty than max_step). Only the
"seqlen" curriculum changes what the forward receives; any other curriculum_type is reported as not
implemented by name.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slipstream.config.schema.data import CurriculumLearningConfig

if TYPE_CHECKING:
    from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["CurriculumPlan", "LayerDropPlan", "SchedulesPlan", "schedules_plan"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CurriculumPlan:
    """A difficulty schedule (field docs: the schema's keys)."""

    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    """"fixed_linear" | "fixed_root" | "fixed_discrete"."""
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
    """What the engine adds to the forward's keyword arguments in training; None: that schedule is off."""

    curriculum: CurriculumPlan | None
    """Hands `curriculum_seqlen` (the seqlen curriculum only)."""
    layer_drop: LayerDropPlan | None
    """Hands `progressive_layer_drop=True, pld_theta=...`."""


_NEEDS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
}


def schedules_plan(cfg: DeepSpeedConfig, problems: list[str], unimplemented: list[str]) -> SchedulesPlan:
    """Both schedules; a missing key is a problem naming it, a curriculum other than seqlen is reported."""
    curriculum, layer_drop = cfg.curriculum_learning, cfg.progressive_layer_drop
    drop = LayerDropPlan(theta=layer_drop.theta, gamma=layer_drop.gamma) if layer_drop.enabled else None
    plan = None
    if curriculum.enabled:
        plan = _curriculum_plan(curriculum, problems)
        if curriculum.curriculum_type != "seqlen":
            unimplemented.append(f"curriculum_learning.curriculum_type={curriculum.curriculum_type}")
            plan = None
    return SchedulesPlan(curriculum=plan, layer_drop=drop)


def _curriculum_plan(section: CurriculumLearningConfig, problems: list[str]) -> CurriculumPlan | None:
    where = "curriculum_learning"
    missing = [
        f"{where}.{key}"
        for key in ("curriculum_type", "min_difficulty", "max_difficulty", "schedule_type")
        if getattr(section, key) is None
    ]
    schedule = section.schedule_config
    if section.schedule_type is not None:
        missing += [
            f"{where}.schedule_config.{key}" for key in _NEEDS[section.schedule_type] if getattr(schedule, key) is None
        ]
    kind, low, high = section.schedule_type, section.min_difficulty, section.max_difficulty
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
