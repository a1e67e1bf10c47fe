"""What the engine adds to the model's forward keyword arguments in training (module.training true), as
DeepSpeed's engine does:
- progressive layer drop: `progressive_layer_drop=True, pld_theta=<keep probability>`;
- the legacy seqlen curriculum: the difficulty is moved to the schedule's value at global_steps + 1 and handed
  as `curriculum_seqlen=<length>` (the model truncates its batch to it).
Evaluation forwards (module.eval()) get nothing added. The pipeline engine's schedules do not call forward()
and get nothing either, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping

from slipstream.config.data_plans import SchedulesPlan
from slipstream.data.curriculum import CurriculumScheduler
from slipstream.data.layer_drop import ProgressiveLayerDrop

__all__ = ["ForwardSchedules"]


class ForwardSchedules:
    """The schedules of one `SchedulesPlan`; `add_to(kwargs, ...)` is the engine's one hook."""

    def __init__(self, plan: SchedulesPlan) -> None:
        self.curriculum = None if plan.curriculum is None else CurriculumScheduler(plan.curriculum)
        self.layer_drop = None if plan.layer_drop is None else ProgressiveLayerDrop(plan.layer_drop)

    @property
    def active(self) -> bool:
        return self.curriculum is not None or self.layer_drop is not None

    def add_to(self, kwargs: dict[str, object], *, training: bool, global_steps: int) -> dict[str, object]:
        """`kwargs` with the schedules' values added (the same dict when nothing is added)."""
        if not training or not self.active:
            return kwargs
        kwargs = dict(kwargs)
        if self.layer_drop is not None:
            self.layer_drop.theta_for_step(global_steps)
            kwargs.update(self.layer_drop.get_state())
        if self.curriculum is not None:
            kwargs["curriculum_seqlen"] = self.curriculum.update_difficulty(global_steps + 1)
        return kwargs

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint keeps (the curriculum's current difficulty; layer drop follows the global step)."""
        return {} if self.curriculum is None else {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        saved = state.get("curriculum")
        if self.curriculum is not None and isinstance(saved, dict):
            self.curriculum.load_state_dict(saved)
