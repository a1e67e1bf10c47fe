"""What the engine adds to the model's forward keyword arguments in training (module.training true), as
DeepSpeed's engine does:
- progressive layer drop: `progressive_layer_drop=True, pld_theta=<keep probability>`;
- the legacy seqlen curriculum: the difficulty is moved to the schedule's value at global_steps + 1 and handed
  as `curriculum_seqlen=<length>` (the model truncates its batch to it);
- random-LTD adds nothing: its kept-token count is moved to the schedule's value at global_steps, and the
  wrapped layers read it (data/random_ltd.py).
Evaluation forwards (module.eval()) get nothing added. The pipeline engine's schedules do not call forward()
and get nothing either, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping

from slipstream.config.data_plans import SchedulesPlan
from slipstream.data.curriculum import CurriculumScheduler
from slipstream.data.layer_drop import ProgressiveLayerDrop
from slipstream.data.random_ltd import RandomLTDScheduler

__all__ = ["ForwardSchedules"]


class ForwardSchedules:
    """The schedules of one `SchedulesPlan`; `add_to(kwargs, ...)` is the engine's one hook."""

    def __init__(self, plan: SchedulesPlan, train_batch_size: int = 0) -> None:
        """`train_batch_size`: the global batch (random-LTD counts the layer tokens consumed)."""
        self.curriculum = None if plan.curriculum is None else CurriculumScheduler(plan.curriculum)
        self.layer_drop = None if plan.layer_drop is None else ProgressiveLayerDrop(plan.layer_drop)
        ltd = plan.random_ltd
        self.random_ltd = None if ltd is None else RandomLTDScheduler(ltd, train_batch_size=train_batch_size)

    @property
    def active(self) -> bool:
        return self.curriculum is not None or self.layer_drop is not None or self.random_ltd is not None

    def add_to(self, kwargs: dict[str, object], *, training: bool, global_steps: int) -> dict[str, object]:
        """`kwargs` with the schedules' values added (the same dict when nothing is added)."""
        if not training or not self.active:
            return kwargs
        if self.random_ltd is not None:
            self.random_ltd.update_seq(global_steps)
        kwargs = dict(kwargs)
        if self.layer_drop is not None:
            self.layer_drop.theta_for_step(global_steps)
            kwargs.update(self.layer_drop.get_state())
        if self.curriculum is not None:
            kwargs["curriculum_seqlen"] = self.curriculum.update_difficulty(global_steps + 1)
        return kwargs

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint keeps (the curriculum's current difficulty, random-LTD's kept count and consumed
        tokens; layer drop follows the global step)."""
        state: dict[str, object] = {} if self.curriculum is None else {"curriculum": self.curriculum.state_dict()}
        if self.random_ltd is not None:
            state["random_ltd"] = self.random_ltd.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        saved = state.get("curriculum")
        if self.curriculum is not None and isinstance(saved, dict):
            self.curriculum.load_state_dict(saved)
        saved = state.get("random_ltd")
        if self.random_ltd is not None and isinstance(saved, dict):
            self.random_ltd.load_state_dict(saved)
