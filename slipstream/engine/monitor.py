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

import dataclasses


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
