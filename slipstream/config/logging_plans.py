"""The plans of progress logging and the monitors (`steps_per_print`, `wall_clock_breakdown`, `csv_monitor`,
`tensorboard`, `wandb`, `comet`, `flops_profiler`, `comms_logger`, `timers`), resolved by config/resolve.py.

Kept apart from config/plan.py (which re-exports them) so that module stays under the size limit; the same
rules hold: frozen, no defaults, every field filled by resolve().
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CometPlan", "CommsLogPlan", "FlopsProfilePlan", "LoggingPlan", "MonitorPlan", "WandbPlan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbPlan:
    """The `wandb` section, enabled: Weights & Biases run settings."""

    project: str
    group: str | None
    team: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class CometPlan:
    """The `comet` section, enabled: Comet experiment settings."""

    project: str | None
    workspace: str | None
    api_key: str | None
    experiment_name: str | None
    experiment_key: str | None
    online: bool | None
    mode: str | None
    samples_log_interval: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorPlan:
    """Output paths of the enabled monitors; None means that monitor is disabled."""

    csv_output_path: str | None
    csv_job_name: str
    tensorboard_output_path: str | None
    tensorboard_job_name: str
    wandb: WandbPlan | None
    comet: CometPlan | None


@dataclass(frozen=True, kw_only=True, slots=True)
class FlopsProfilePlan:
    """The `flops_profiler` section, enabled: profile one step's forward and print it."""

    profile_step: int
    module_depth: int
    top_modules: int
    detailed: bool
    output_file: str | None
    recompute_fwd_factor: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CommsLogPlan:
    """The `comms_logger` section, enabled: per-collective counts, bytes and time."""

    verbose: bool
    prof_all: bool
    prof_ops: tuple[str, ...]
    debug: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingPlan:
    """Progress logging and monitors."""

    steps_per_print: int | None
    wall_clock_breakdown: bool
    monitor: MonitorPlan
    flops_profile: FlopsProfilePlan | None
    comms_log: CommsLogPlan | None
    throughput_timer: bool
    """`timers.throughput.enabled`: engine.tput_timer counts and times (False: it stays at zero)."""
    throughput_synchronized: bool
    """`timers.throughput.synchronized`: the timer synchronises the device before reading the clock."""
