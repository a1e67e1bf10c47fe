"""Monitor and logging sections: `tensorboard`, `csv_monitor`, `wandb`, `comet`, `comms_logger`,
`flops_profiler`, `timers`. Defaults are DeepSpeed 0.19's (`deepspeed/monitor/config.py`,
`profiling/config.py`)."""

from __future__ import annotations

from pydantic import Field

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, DSModel, plan_fields

__all__ = [
    "CSVConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "TimersConfig",
    "WandbConfig",
]


class _EventFilesConfig(DSModel):
    """A monitor that writes Train/Samples/* events into files under `output_path/job_name`."""

    enabled: DSBool = False
    """Write the events."""
    output_path: str = ""
    """Directory for the event files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this run."""


def _event_files_plan(monitor: str) -> dict[str, str]:
    """The `IMPLEMENTED` map of a file monitor: its plan fields are `<monitor>_output_path` and `_job_name`."""
    output = f"logging.monitor.{monitor}_output_path"
    return {"enabled": output, "output_path": output, "job_name": f"logging.monitor.{monitor}_job_name"}


class TensorBoardConfig(_EventFilesConfig):
    """`tensorboard`: write Train/Samples/* events with torch.utils.tensorboard."""

    IMPLEMENTED = _event_files_plan("tensorboard")


class CSVConfig(_EventFilesConfig):
    """`csv_monitor`: write Train/Samples/* events as CSV files."""

    IMPLEMENTED = _event_files_plan("csv")


class WandbConfig(DSModel):
    """`wandb`: log to Weights & Biases."""

    IMPLEMENTED = plan_fields("logging.monitor.wandb", "group", "team", "project", enabled="logging.monitor.wandb")

    enabled: DSBool = False
    """Log to W&B."""
    group: str | None = None
    """W&B group."""
    team: str | None = None
    """W&B team (entity)."""
    project: str = "deepspeed"
    """W&B project."""


class CometConfig(DSModel):
    """`comet`: log to Comet."""

    IMPLEMENTED = plan_fields(
        "logging.monitor.comet",
        "samples_log_interval",
        "project",
        "workspace",
        "api_key",
        "experiment_name",
        "experiment_key",
        "online",
        "mode",
        enabled="logging.monitor.comet",
    )

    enabled: DSBool = False
    """Log to Comet."""
    samples_log_interval: DSInt = Field(100, ge=1)
    """Log every N samples."""
    project: str | None = None
    """Comet project."""
    workspace: str | None = None
    """Comet workspace."""
    api_key: str | None = None
    """Comet API key."""
    experiment_name: str | None = None
    """Experiment name."""
    experiment_key: str | None = None
    """Experiment key."""
    online: DSBool | None = None
    """Log online."""
    mode: str | None = None
    """Comet mode ("get", "create", "get_or_create")."""


class CommsLoggerConfig(DSModel):
    """`comms_logger`: log every collective."""

    IMPLEMENTED = plan_fields(
        "logging.comms_log", "verbose", "prof_all", "prof_ops", "debug", enabled="logging.comms_log"
    )

    enabled: DSBool = False
    """Log collectives."""
    verbose: DSBool = False
    """Log each call as it happens."""
    prof_all: DSBool = True
    """Profile all collectives."""
    prof_ops: list[str] = Field(default_factory=list)
    """Collectives to profile when prof_all is false."""
    debug: DSBool = False
    """Include the caller in the log."""


class FlopsProfilerConfig(DSModel):
    """`flops_profiler`: profile one step's FLOPs and latency."""

    IMPLEMENTED = plan_fields(
        "logging.flops_profile",
        "recompute_fwd_factor",
        "profile_step",
        "module_depth",
        "top_modules",
        "detailed",
        "output_file",
        enabled="logging.flops_profile",
    )

    enabled: DSBool = False
    """Run the profiler."""
    recompute_fwd_factor: DSFloat = 0.0
    """Extra forward cost from activation recomputation."""
    profile_step: DSInt = 1
    """Step to profile."""
    module_depth: DSInt = -1
    """Module depth to report; -1 is all."""
    top_modules: DSInt = 1
    """Top modules to list."""
    detailed: DSBool = True
    """Print the per-module profile."""
    output_file: str | None = None
    """File to write; None prints to stdout."""


class ThroughputTimerConfig(DSModel):
    """`timers.throughput`."""

    IMPLEMENTED = {
        "enabled": "logging.throughput_timer",
        "synchronized": "logging.throughput_synchronized",
    }

    enabled: DSBool = True
    """Measure throughput."""
    synchronized: DSBool = True
    """Synchronise the device before reading the clock."""


class TimersConfig(DSModel):
    """`timers`."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """Throughput timer."""
