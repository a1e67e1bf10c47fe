"""The difficulty schedules of DeepSpeed's curriculum learning (the legacy `curriculum_learning` section).

A difficulty (a sequence length for the seqlen curriculum) for each global step, from min_difficulty to
max_difficulty:
- fixed_linear / fixed_root: floor(min + (max - min) * (step / total_step) ** (1 / root_degree)), rounded down
  to a multiple of difficulty_step but never below the first multiple at or above min_difficulty, and never
  above max_difficulty (fixed_linear is root_degree 1);
- fixed_discrete: difficulties[i] while step <= max_steps[i], the last difficulty after the last max step;
- custom: what the user's function (step -> difficulty, `set_custom_get_difficulty`) returns; asking for a
  difficulty before the function is set is an error naming that method.
The scheduler keeps the current difficulty and stops moving it once it reaches max_difficulty, as DeepSpeed's
does; its state (the current difficulty) travels in checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from slipstream.config.data_plans import CurriculumPlan

__all__ = ["CurriculumScheduler"]


class CurriculumScheduler:
    """The difficulty per global step for one `CurriculumPlan`."""

    def __init__(self, plan: CurriculumPlan) -> None:
        self.plan = plan
        self.current_difficulty = plan.min_difficulty
        self.custom_get_difficulty: Callable[[int], int] | None = None
        """The custom schedule's function (global step -> difficulty); the user sets it at run time."""

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The difficulty function of a `schedule_type: "custom"` schedule (DeepSpeed's method name)."""
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at `global_steps` (whatever the current difficulty is)."""
        plan = self.plan
        if plan.schedule_type == "custom":
            return self._custom_difficulty(global_steps)
        if plan.schedule_type == "fixed_discrete":
            for difficulty, last_step in zip(plan.difficulties, plan.max_steps):
                if global_steps <= last_step:
                    return difficulty
            return plan.difficulties[-1]
        fraction = (float(global_steps) / plan.total_step) ** (1.0 / plan.root_degree)
        low, high, step = plan.min_difficulty, plan.max_difficulty, plan.difficulty_step
        difficulty = math.floor(fraction * (high - low) + low)
        difficulty -= difficulty % step
        difficulty = max(difficulty, -(-low // step) * step)  # a zero length would be no sequence at all
        return min(difficulty, high)

    def _custom_difficulty(self, global_steps: int) -> int:
        if self.custom_get_difficulty is None:
            raise RuntimeError(
                f"curriculum schedule_type 'custom' has no difficulty function at step {global_steps}; call "
                "set_custom_get_difficulty(fn) with fn(global_steps) -> difficulty before training (for the "
                "curriculum_learning section: engine.curriculum_scheduler_legacy.set_custom_get_difficulty(fn))"
            )
        return int(self.custom_get_difficulty(global_steps))

    def update_difficulty(self, global_steps: int) -> int:
        """Move the current difficulty to the schedule's at `global_steps` (until it has reached the maximum)."""
        if self.current_difficulty < self.plan.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty

    def get_current_difficulty(self) -> int:
        return self.current_difficulty

    def set_current_difficulty(self, difficulty: int) -> None:
        self.current_difficulty = int(difficulty)

    def state_dict(self) -> dict[str, int]:
        return {"current_difficulty": self.current_difficulty}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.current_difficulty = int(state["current_difficulty"])
