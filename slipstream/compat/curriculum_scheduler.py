"""`deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`: DeepSpeed's constructor (a
curriculum config as a dict: min_difficulty, max_difficulty, schedule_type, schedule_config) and its state
methods over Slipstream's difficulty schedules (data/curriculum.py, the same rules as the config's
`curriculum_learning` section, checked by the same code). The "custom" schedule asks the function given to
`set_custom_get_difficulty` (held by that schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from slipstream.config.data_plans import schedule_plan
from slipstream.config.schema.data import CurriculumScheduleConfig
from slipstream.data.curriculum import CurriculumScheduler as _Schedule

__all__ = ["CurriculumScheduler"]

_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
_REQUIRED = ("min_difficulty", "max_difficulty", "schedule_type")


def _schedule_config(config: Mapping[str, object]) -> dict[str, object]:
    raw = config.get("schedule_config") or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"CurriculumScheduler: schedule_config must be a dict, got {raw!r}")
    return dict(raw)


def _schedule(config: Mapping[str, object]) -> _Schedule:
    """Slipstream's schedule for a DeepSpeed curriculum config (ValueError naming a bad key)."""
    problems: list[str] = []
    schedule = CurriculumScheduleConfig.model_validate(_schedule_config(config))
    limits = (config["min_difficulty"], config["max_difficulty"], config["schedule_type"])
    plan = schedule_plan("CurriculumScheduler config", limits, schedule, problems)  # type: ignore[arg-type]
    if plan is None:
        raise ValueError("; ".join(problems))
    return _Schedule(plan)


class CurriculumScheduler:
    """The difficulty per global step; `state` holds DeepSpeed's keys (current_difficulty and the config)."""

    def __init__(self, config: Mapping[str, object]) -> None:
        missing = [key for key in _REQUIRED if key not in config]
        if missing:
            raise ValueError(f"CurriculumScheduler: the config has no {', '.join(missing)}; set {list(_REQUIRED)}")
        if config["schedule_type"] not in _TYPES:
            raise ValueError(f"CurriculumScheduler: schedule_type {config['schedule_type']!r} is not one of {_TYPES}")
        self.state: dict[str, object] = {key: config[key] for key in _REQUIRED}
        self.state["current_difficulty"] = config["min_difficulty"]
        self._schedule = _schedule(config)
        if config["schedule_type"] != "custom":
            self.state["schedule_config"] = _schedule_config(config)

    @property
    def custom_get_difficulty(self) -> Callable[[int], int] | None:
        """The custom schedule's function (DeepSpeed's attribute)."""
        return self._schedule.custom_get_difficulty

    def get_current_difficulty(self) -> int:
        return int(self.state["current_difficulty"])  # type: ignore[call-overload]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        self._schedule.set_custom_get_difficulty(schedule_function)

    def get_state(self) -> dict[str, object]:
        return self.state

    def set_state(self, state: dict[str, object]) -> None:
        self.state = state

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at `global_steps` (custom: RuntimeError naming set_custom_get_difficulty
        while no function is set)."""
        return self._schedule.get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Move the current difficulty to the schedule's at `global_steps`, until it has reached the maximum."""
        if self.get_current_difficulty() < int(self.state["max_difficulty"]):  # type: ignore[call-overload]
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.get_current_difficulty()
