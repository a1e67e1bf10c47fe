"""What the engine reports beyond the step line: the flops profiler at its step, and the comms logger.

The profiler (`flops_profiler` section) counts the forward of the first micro-batch of step `profile_step`
and prints the profile on rank 0 when that step ends; from then on the step line also shows achieved FLOP/s
(the training step taken as 3 forwards, plus `recompute_fwd_factor`) and MFU where the device's peak is known.
The comms logger (`comms_logger` section) counts every collective the engine and its components issue
(calls, bytes, time) with the collectives layer's own counter, summarised every `steps_per_print` steps and
by `engine.comms_summary()`. `step_observers` lists what hears of each optimizer step's end (the profiler, an
autotuning trial).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from slipstream.accelerator.peak import peak_flops
from slipstream.autotuning.trial import trial_recorder
from slipstream.comm import counting
from slipstream.config.plan import CommsLogPlan, EnginePlan, FlopsProfilePlan
from slipstream.profiling.flops_profiler import FlopsProfiler, number_to_string, training_flops
from slipstream.utils.logging import log_rank0

__all__ = ["CommsLog", "StepObserver", "StepProfiler", "step_observers", "step_profiler"]


class StepObserver(Protocol):
    """Told the number of every optimizer step that ends (1-based)."""

    def step_ended(self, step: int) -> None: ...


def step_profiler(plan: EnginePlan, module: nn.Module, *, rank: int) -> StepProfiler | None:
    """The flops profiler when the `flops_profiler` section is enabled, else None."""
    flops = plan.logging.flops_profile
    if flops is None:
        return None
    return StepProfiler(flops, module, rank=rank, accumulation=plan.batch.gradient_accumulation_steps)


def step_observers(
    profiler: StepProfiler | None, plan: EnginePlan, module: nn.Module, *, rank: int
) -> list[StepObserver]:
    """What the engine tells after each optimizer step: the flops profiler, and the autotuning trial recorder
    when the run is profiled for the tuner (slipstream/autotuning/trial.py; it may end the run)."""
    trial = trial_recorder(plan, module, rank=rank)
    return [observer for observer in (profiler, trial) if observer is not None]


class StepProfiler:
    """Profiles the forward of step `profile_step` (1-based, as DeepSpeed counts) and keeps its FLOPs."""

    def __init__(self, plan: FlopsProfilePlan, module: nn.Module, *, rank: int, accumulation: int) -> None:
        self.plan, self.module, self.rank, self.accumulation = plan, module, rank, accumulation
        self.flops_per_step: int | None = None
        self._profiler: FlopsProfiler | None = None

    def forward(self, run: Callable[[], object], step: int, first_micro_batch: bool) -> Any:
        """Run one forward (`run()`), profiled when it is the first micro-batch of the profiled step."""
        if step + 1 != self.plan.profile_step or not first_micro_batch or self.flops_per_step is not None:
            return run()
        self._profiler = FlopsProfiler(self.module, recompute_fwd_factor=self.plan.recompute_fwd_factor)
        self._profiler.start_profile()
        try:
            return run()
        finally:
            self._profiler.stop_profile()

    def step_ended(self, step: int) -> None:
        """After optimizer step `step` (1-based): print the profile of the profiled step, once."""
        profiler = self._profiler
        if profiler is None or step != self.plan.profile_step:
            return
        forward = int(profiler.get_total_flops()) * self.accumulation
        self.flops_per_step = training_flops(forward, self.plan.recompute_fwd_factor)
        if self.rank == 0:
            text = profiler.render(
                profile_step=step,
                module_depth=self.plan.module_depth,
                top_modules=self.plan.top_modules,
                detailed=self.plan.detailed,
            )
            if self.plan.output_file:
                with open(self.plan.output_file, "w", encoding="utf-8") as handle:
                    handle.write(text)
            else:
                log_rank0("flops profile:\n" + text, rank=self.rank)
        profiler.end_profile()
        self._profiler = None

    def rates(self, step_time_s: float, device_name: str, dtype: torch.dtype) -> str:
        """'1.2 GFLOP/s per rank, MFU 31.0%' for the step line (each rank's own micro-batches), or '' before
        the profiled step."""
        if self.flops_per_step is None or step_time_s <= 0:
            return ""
        achieved = self.flops_per_step / step_time_s
        text = f"{number_to_string(achieved, 'FLOP/s')} per rank"
        peak = peak_flops(device_name, dtype)
        if peak is not None:
            text += f", MFU {100.0 * achieved / peak:.1f}%"
        return text


class CommsLog:
    """The comms logger: a collective counter alive for the engine's lifetime."""

    def __init__(self, plan: CommsLogPlan, *, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.counter = counting.CollectiveCounter(listener=self._issued if plan.verbose else None)
        counting.start(self.counter)

    def _shown(self, op: str) -> bool:
        return self.plan.prof_all or op in self.plan.prof_ops

    def _issued(self, op: str, size: int, site: str) -> None:
        if self._shown(op):
            where = f" from {site}" if self.plan.debug and site else ""
            log_rank0(f"comm: {op} {number_to_string(size, 'B')}{where}", rank=self.rank)

    def summary(self) -> str:
        """One line per collective kind: calls, bytes, total and mean time, algorithmic bandwidth."""
        rows = []
        for op in sorted(self.counter.calls):
            if not self._shown(op):
                continue
            calls, size, seconds = self.counter.calls[op], self.counter.bytes[op], self.counter.seconds[op]
            rate = f"{number_to_string(size / seconds, 'B/s')}" if seconds > 0 else "n/a"
            rows.append(
                f"{op:<16} {calls:>6} calls  {number_to_string(size, 'B'):>10}  {seconds * 1000:9.2f} ms total  "
                f"{seconds * 1000 / max(calls, 1):8.3f} ms mean  {rate}"
            )
        return "comms summary (since the last summary):\n" + ("\n".join(rows) if rows else "no collectives")

    def report(self) -> str:
        text = self.summary()
        log_rank0(text, rank=self.rank)
        self.counter.reset()
        return text

    def close(self) -> None:
        counting.stop(self.counter)
