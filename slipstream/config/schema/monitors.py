"""Monitor and logging sections: `tensorboard`, `csv_monitor`, `wandb`, `comet`, `comms_logger`,
`flops_profiler`, `timers`. Defaults are DeepSpeed 0.19's (`deepspeed/monitor/config.py`,
`profiling/config.py`)."""

from __future__ import annotations

from pydantic import Field

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, DSModel

__all__ = [
    "CSVConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "TimersConfig",
    "WandbConfig",
]


class TensorBoardConfig(DSModel):
    """`tensorboard`: write Train/Samples/* events with torch.utils.tensorboard."""

    IMPLEMENTED = {
        "enabled": "logging.monitor.tensorboard_output_path",
        "output_path": "logging.monitor.tensorboard_output_path",
        "job_name": "logging.monitor.tensorboard_job_name",
    }
    enabled: DSBool = False
    """Write TensorBoard events."""
    output_path: str = ""
    """Directory for the event files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this run."""


class CSVConfig(DSModel):
    """`csv_monitor`: write Train/Samples/* events as CSV files."""

    IMPLEMENTED = {
        "enabled": "logging.monitor.csv_output_path",
        "output_path": "logging.monitor.csv_output_path",
        "job_name": "logging.monitor.csv_job_name",
    }
    enabled: DSBool = False
    """Write CSV files."""
    output_path: str = ""
    """Directory for the CSV files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this run."""


class WandbConfig(DSModel):
    """`wandb`: log to Weights & Biases."""

    IMPLEMENTED = {
        "enabled": "logging.monitor.wandb",
        "group": "logging.monitor.wandb.group",
        "team": "logging.monitor.wandb.team",
        "project": "logging.monitor.wandb.project",
    }

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

    IMPLEMENTED = {
        "enabled": "logging.monitor.comet",
        "samples_log_interval": "logging.monitor.comet.samples_log_interval",
        "project": "logging.monitor.comet.project",
        "workspace": "logging.monitor.comet.workspace",
        "api_key": "logging.monitor.comet.api_key",
        "experiment_name": "logging.monitor.comet.experiment_name",
        "experiment_key": "logging.monitor.comet.experiment_key",
        "online": "logging.monitor.comet.online",
        "mode": "logging.monitor.comet.mode",
    }

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

    IMPLEMENTED = {
        "enabled": "logging.comms_log",
        "verbose": "logging.comms_log.verbose",
        "prof_all": "logging.comms_log.prof_all",
        "prof_ops": "logging.comms_log.prof_ops",
        "debug": "logging.comms_log.debug",
    }

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

    IMPLEMENTED = {
        "enabled": "logging.flops_profile",
        "recompute_fwd_factor": "logging.flops_profile.recompute_fwd_factor",
        "profile_step": "logging.flops_profile.profile_step",
        "module_depth": "logging.flops_profile.module_depth",
        "top_modules": "logging.flops_profile.top_modules",
        "detailed": "logging.flops_profile.detailed",
        "output_file": "logging.flops_profile.output_file",
    }

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
