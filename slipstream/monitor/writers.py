"""The monitors: csv, tensorboard, wandb and comet writers of `(event name -> value)` at a sample count, built
from the plan's monitor sections. The engine writes its step events through them (engine/monitor.py says which);
DeepSpeed's `MonitorMaster` (compat/monitor_master.py) fans a caller's events out to them. The csv monitor writes
one file per event, `<output_path>/<job_name>/<event with / as _>.csv`, with a `step,value` header."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from slipstream.config.plan import CometPlan, MonitorPlan, WandbPlan


class CsvMonitor:
    def __init__(self, output_path: str, job_name: str) -> None:
        self.directory = Path(output_path or ".") / job_name
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, events: dict[str, float], samples: int) -> None:
        for name, value in events.items():
            path = self.directory / (name.replace("/", "_") + ".csv")
            new = not path.exists()
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(["step", "value"])
                writer.writerow([samples, value])


class TensorboardMonitor:
    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(
                "the tensorboard section is enabled but the tensorboard package is not installed; "
                "`pip install tensorboard` or set tensorboard.enabled to false"
            ) from exc
        self.writer: Any = SummaryWriter(log_dir=os.path.join(output_path or "runs", job_name))

    def write(self, events: dict[str, float], samples: int) -> None:
        for name, value in events.items():
            self.writer.add_scalar(name, value, samples)
        self.writer.flush()


def _import(package: str, section: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise RuntimeError(
            f"the {section} section is enabled but the {package} package is not installed; "
            f"`pip install {package.replace('_', '-')}` or set {section}.enabled to false"
        ) from exc


class WandbMonitor:
    """Weights & Biases: one run per job (rank 0 only), the step line's figures indexed by samples."""

    def __init__(self, plan: WandbPlan) -> None:
        self.wandb = _import("wandb", "wandb")
        self.run = self.wandb.init(project=plan.project, group=plan.group, entity=plan.team)

    def write(self, events: dict[str, float], samples: int) -> None:
        self.wandb.log(dict(events), step=samples)


class CometMonitor:
    """Comet: one experiment (rank 0 only); each event logged when `samples_log_interval` samples have passed
    since that event was last logged (its first value always), as DeepSpeed's comet monitor does."""

    def __init__(self, plan: CometPlan) -> None:
        comet = _import("comet_ml", "comet")
        options = {
            "api_key": plan.api_key,
            "project": plan.project,
            "workspace": plan.workspace,
            "experiment_key": plan.experiment_key,
            "mode": plan.mode,
            "online": plan.online,
        }
        self.experiment = comet.start(**{k: v for k, v in options.items() if v is not None})
        if plan.experiment_name is not None:
            self.experiment.set_name(plan.experiment_name)
        self.interval = plan.samples_log_interval
        self._last_logged: dict[str, int] = {}

    def write(self, events: dict[str, float], samples: int) -> None:
        due = {
            name: value
            for name, value in events.items()
            if name not in self._last_logged or samples - self._last_logged[name] >= self.interval
        }
        if not due:
            return
        self.experiment.log_metrics(due, step=samples)
        self._last_logged.update(dict.fromkeys(due, samples))


def make_monitors(plan: MonitorPlan) -> list[Any]:
    """The writers of the enabled monitor sections (the engine builds them on rank 0 only)."""
    monitors: list[Any] = []
    if plan.csv_output_path is not None:
        monitors.append(CsvMonitor(plan.csv_output_path, plan.csv_job_name))
    if plan.tensorboard_output_path is not None:
        monitors.append(TensorboardMonitor(plan.tensorboard_output_path, plan.tensorboard_job_name))
    if plan.wandb is not None:
        monitors.append(WandbMonitor(plan.wandb))
    if plan.comet is not None:
        monitors.append(CometMonitor(plan.comet))
    return monitors
