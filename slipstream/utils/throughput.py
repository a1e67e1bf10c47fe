"""`ThroughputTimer`: samples per second over optimizer steps, after a warm-up (DeepSpeed's `engine.tput_timer`,
`deepspeed.utils.timer.ThroughputTimer`).

The engine calls `start()` at each forward and `stop(global_step=...)` at each `step()`; every stop counts a
micro-batch, a stop at the accumulation boundary counts an optimizer step. Time is measured only from step
`start_step` on (the first steps pay for allocation and warm-up), as the sum of start-to-stop spans, so time
spent outside forward-to-step (data loading, logging) is not counted. `avg_samples_per_sec()` is `batch_size`
(the global batch of one optimizer step) over the mean timed step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    def __init__(
        self,
        config: object = None,
        batch_size: int | None = 1,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], object] | None = None,
        *,
        enabled: bool = True,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.batch_size = 1 if batch_size is None else int(batch_size)
        """Samples in one optimizer step."""
        self.start_step = int(start_step)
        """Optimizer steps left out of the timing (warm-up)."""
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn
        self.enabled = enabled
        """False: start() and stop() do nothing (`timers.throughput.enabled: false`)."""
        self.synchronize = synchronize
        """Called before each clock reading (the device's synchronize: `timers.throughput.synchronized`)."""
        self.initialized = False
        self.started = False
        self.start_time = 0.0
        self.end_time = 0.0
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        """Seconds timed since step `start_step`."""
        self.step_elapsed_time = 0.0
        """Seconds timed in the current optimizer step so far."""

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A micro-batch begins; timing starts once `start_step` optimizer steps are done."""
        if not self.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """A micro-batch ends (`global_step`: and with it an optimizer step). No effect before the first start()."""
        if not self.initialized:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = self._now()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                if report_speed and self.logging is not None and self._report_boundary():
                    self.logging(
                        f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                        f"global_step={self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                        f"CurrSamplesPerSec={self.batch_size / max(self.step_elapsed_time, 1e-12)}"
                    )
                self.step_elapsed_time = 0.0

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.time()

    def _report_boundary(self) -> bool:
        every = self.steps_per_output
        return every is not None and every > 0 and self.global_step_count % int(every) == 0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps; -inf until one has been timed."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)
