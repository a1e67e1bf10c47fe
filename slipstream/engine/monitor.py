"""Training figures: the monitors' events at every optimizer step, and the rank-0 progress line every
`steps_per_print` steps.

The monitors (csv, tensorboard, wandb, comet) write DeepSpeed's events at every optimizer step, whatever
`steps_per_print` is, indexed by global samples (the count after the step) as DeepSpeed does:
`Train/Samples/lr`, `Train/Samples/loss_scale` (fp16 only) and `Train/Samples/train_loss` (the batch's mean
loss, as DeepSpeed's pipeline engine writes it), plus `Train/Samples/grad_norm`. The figures of a print window
(`Train/Samples/samples_per_sec`, `Train/Samples/memory_bytes`, what `slipstream plot` draws beside them) go
out with the progress line, so only when `steps_per_print` is set. The csv monitor writes one file per event,
`<output_path>/<job_name>/<event with / as _>.csv`, with a `step,value` header.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path
from typing import Any

from slipstream.config.plan import CometPlan, WandbPlan


@dataclasses.dataclass(frozen=True, slots=True)
class StepFigures:
    step: int
    samples: int
    loss: float | None
    lr: float
    grad_norm: float | None
    loss_scale: float | None
    samples_per_s: float
    step_time_s: float
    breakdown: dict[str, float] | None = None
    rates: str = ""  # achieved FLOP/s and MFU once the flops profiler has counted a step
    memory_bytes: int | None = None  # the accelerator's allocated bytes (process RSS on the CPU)

    def line(self) -> str:
        parts = [
            f"step {self.step}",
            f"loss {self.loss:.4f}" if self.loss is not None else "loss n/a",
            f"lr {self.lr:.3e}",
            f"grad_norm {self.grad_norm:.4f}" if self.grad_norm is not None else "grad_norm n/a",
        ]
        if self.loss_scale is not None:
            parts.append(f"loss_scale {self.loss_scale:g}")
        parts += [f"{self.samples_per_s:.1f} samples/s", f"step {self.step_time_s * 1000:.1f} ms"]
        if self.rates:
            parts.append(self.rates)
        if self.breakdown:
            parts.append(" ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.breakdown.items()))
        return " | ".join(parts)

    def window_events(self) -> dict[str, float]:
        """The print window's figures, written with the progress line."""
        out = {"Train/Samples/samples_per_sec": self.samples_per_s}
        if self.memory_bytes is not None:
            out["Train/Samples/memory_bytes"] = float(self.memory_bytes)
        return out


def step_events(
    *, lr: float, loss: float | None, grad_norm: float | None, loss_scale: float | None
) -> dict[str, float]:
    """The events of one optimizer step, written at every step (DeepSpeed's names; `loss_scale` None without
    fp16, `loss` None when no engine.backward() ran in the window)."""
    out = {"Train/Samples/lr": lr}
    if loss is not None:
        out["Train/Samples/train_loss"] = loss
    if grad_norm is not None:
        out["Train/Samples/grad_norm"] = grad_norm
    if loss_scale is not None:
        out["Train/Samples/loss_scale"] = loss_scale
    return out


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
