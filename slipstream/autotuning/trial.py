"""The engine's side of a trial: time the profiled steps, write the metrics file, end the run.

A run whose config has `autotuning.enabled` (the tuner writes it into every trial's config, as DeepSpeed's
autotuner does) times each of its optimizer steps `start_profile_step + 1 .. end_profile_step` (wall clock from
the end of one step to the end of the next, the device synchronised at each end), writes on rank 0

    {"throughput": samples/s, "latency": s per optimizer step, "mean_latency": s, "steps": n,
     "train_batch_size": ..., "peak_memory": bytes}

to `autotuning.metric_path` and exits with status 0 on every rank. The tuner's profile run instead sets
`PROFILE_ENV` to a request file: it counts the FLOPs of the first optimizer step and times the second per block
(profile.py), then the engine's own model is handed to the planner for every candidate of the request
(estimates.py), the profile written beside the figures, and the run exits.

`latency` is the median of the timed steps (DeepSpeed divides the whole window by its steps, reported here as
`mean_latency`): on a shared machine one step stalled by another process would otherwise rank a candidate below
one half as fast, and a tuner run with few profiled steps would pick it.
"""

from __future__ import annotations

import os
import statistics
import time

from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.autotuning.files import PROFILE_ENV, write_json
from slipstream.autotuning.profile import ProfileTimer
from slipstream.config.plan import EnginePlan

__all__ = ["PROFILE_ENV", "TrialRecorder", "trial_recorder"]


class TrialRecorder:
    """Times the profiled steps of one run (see the module's docstring); `step_ended` after every optimizer step."""

    def __init__(self, plan: EnginePlan, module: nn.Module, *, rank: int) -> None:
        self.plan, self.module, self.rank = plan, module, rank
        self.profile_request = os.environ.get(PROFILE_ENV, "")
        tuning = plan.autotuning
        self.start, self.end = tuning.start_profile_step, max(tuning.end_profile_step, tuning.start_profile_step + 1)
        self.ends: list[float] = [self._now()] if self.start == 0 else []
        """The clock at the end of step `start` and of every later step."""
        batch = plan.batch
        self.timer = (
            ProfileTimer(module, micro_batch=batch.micro_batch_size, grad_accum=batch.gradient_accumulation_steps)
            if self.profile_request
            else None
        )
        get_accelerator().reset_max_memory_allocated()

    @staticmethod
    def _now() -> float:
        get_accelerator().synchronize()
        return time.perf_counter()

    def step_ended(self, step: int) -> None:
        """After optimizer step `step` (1-based): start the clock, or write the figures and end the run."""
        if self.timer is not None:
            if self.timer.step_ended(step):
                self._answer_profile_request()
                raise SystemExit(0)
            return
        if step == self.start or (self.ends and step <= self.end):
            self.ends.append(self._now())
        if step < self.end or not self.ends:
            return
        steps = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        latency = statistics.median(steps)
        batch = self.plan.batch.train_batch_size
        if self.rank == 0:
            write_json(
                self.plan.autotuning.metric_path,
                {
                    "throughput": batch / latency,
                    "latency": latency,
                    "mean_latency": sum(steps) / len(steps),
                    "steps": len(steps),
                    "train_batch_size": batch,
                    "micro_batch": self.plan.batch.micro_batch_size,
                    "peak_memory": int(get_accelerator().max_memory_allocated()),
                },
            )
        raise SystemExit(0)

    def _answer_profile_request(self) -> None:
        from slipstream.autotuning.estimates import answer_request

        if self.rank == 0:
            answer_request(
                self.profile_request,
                module=self.module,
                world_size=self.plan.batch.world_size,
                micro_batch=self.plan.batch.micro_batch_size,
                peak_memory=int(get_accelerator().max_memory_allocated()),
                profile=None if self.timer is None else self.timer.result,
            )


def trial_recorder(plan: EnginePlan, module: nn.Module, *, rank: int) -> TrialRecorder | None:
    """The recorder of a profiled run (`autotuning.enabled`, or the tuner's profile request), else None."""
    if not plan.autotuning.enabled and not os.environ.get(PROFILE_ENV):
        return None
    return TrialRecorder(plan, module, rank=rank)
