"""The attributes of DeepSpeed's engine that Megatron-DeepSpeed reads (`engine.mpu`, `engine.timers`,
`engine.monitor`, `engine.losses`, `engine.has_moe_layers`, `engine.num_experts`,
`engine.curriculum_scheduler_legacy`), computed from the engine's own state (reference:
deepspeed/runtime/engine.py). A base of compat/engine_methods.py's mixin.
"""

from __future__ import annotations

from typing import Any

import torch


class EngineAttributes:
    """Read-only properties over the engine's `parallel`, `plan`, `module`, `monitors` and loss totals."""

    plan: Any
    module: Any
    parallel: Any
    _forward_schedules: Any

    @property
    def mpu(self) -> Any:
        """The model-parallel unit: `deepspeed.utils.groups` with tensor parallelism (as DeepSpeed sets it for
        AutoTP), the sequence-parallel state with sequence parallelism, otherwise None."""
        if self.parallel.tp_size > 1:
            from slipstream.compat import groups

            return groups
        if self.parallel.sp_size > 1:
            from slipstream.compat import parallel_state_sp

            return parallel_state_sp
        return None

    @property
    def has_moe_layers(self) -> bool:
        return bool(self.num_experts)

    @property
    def num_experts(self) -> list[int]:
        """The expert count of each MoE layer, in module order."""
        from slipstream.moe.layer import MoE

        return [int(m.num_experts) for m in self.module.modules() if isinstance(m, MoE)]

    @property
    def timers(self) -> Any:
        """Named wall-clock timers (compat/timers.py); with wall_clock_breakdown off they time nothing."""
        if "_compat_timers" not in self.__dict__:
            from slipstream.compat.timers import NoopTimer, SynchronizedWallClockTimer

            timing = self.plan.logging.wall_clock_breakdown
            self.__dict__["_compat_timers"] = SynchronizedWallClockTimer() if timing else NoopTimer()
        return self.__dict__["_compat_timers"]

    @property
    def monitor(self) -> Any:
        """The enabled monitors as DeepSpeed's MonitorMaster (`engine.monitor.write_events(...)`)."""
        if "_compat_monitor" not in self.__dict__:
            from slipstream.compat.monitor_master import MonitorMaster

            monitors = list(getattr(self, "monitors", []))
            self.__dict__["_compat_monitor"] = MonitorMaster(self.plan.logging.monitor, monitors=monitors)
        return self.__dict__["_compat_monitor"]

    @property
    def losses(self) -> torch.Tensor | None:
        """The sum of the losses given to backward() since the last optimizer step (None right after a step
        and before the first backward), as DeepSpeed accumulates `engine.losses`."""
        totals = getattr(self, "_loss_totals", None)
        if totals is None or float(totals[1]) == 0:
            return None
        return totals[0].detach().clone().float()

    @property
    def curriculum_scheduler_legacy(self) -> Any:
        """The `curriculum_learning` section's schedule (data/curriculum.py; None when the section is off): for
        `schedule_type: "custom"` call its `set_custom_get_difficulty(fn)` before training."""
        return self._forward_schedules.curriculum
