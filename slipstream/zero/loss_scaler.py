"""fp16 loss scaling: the scale, its update after each optimizer step, and the overflow report.

Owns DeepSpeed's dynamic loss-scale rule (runtime/fp16/loss_scaler.py `DynamicLossScaler.update_scale`,
re-derived here), per optimizer step:
- overflow: if the hysteresis budget is spent (`cur_hysteresis == 1`, or hysteresis == 1) the scale halves,
  floored at min_scale; otherwise the budget drops by one and the scale stays.
- no overflow: with consecutive_hysteresis the budget refills at once. The scale doubles when the number of
  clean steps *before* this one since the last overflow (or since the start) is a positive multiple of
  `window`, i.e. on the (window + 1)-th clean step, then every `window` clean steps; without
  consecutive_hysteresis the budget refills only then.

Unlike DeepSpeed, which logs one line per overflow and raises at the first overflow at the minimum scale,
this scaler counts overflows for one aggregated `take_report()` line per logging interval, and `stuck()` turns
true only after `window` consecutive overflowing steps at the minimum scale (the engine then raises, naming the
first parameter with non-finite gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from slipstream.config.plan import LossScalePlan

__all__ = ["DynamicLossScaler", "LossScaler", "StaticLossScaler", "has_overflow", "make_loss_scaler"]


@runtime_checkable
class LossScaler(Protocol):
    """What the engine uses: the scale, scaling a loss, the per-step update, the report and checkpoint state."""

    scale: float

    def scale_loss(self, loss: Tensor) -> Tensor: ...

    def update(self, overflow: bool) -> None: ...

    def stuck(self) -> bool: ...

    def take_report(self) -> str | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None: ...


def has_overflow(grads: Iterable[Tensor | None]) -> bool:
    """True when any gradient holds an inf or a NaN (None entries are skipped); one host sync per device."""
    flags: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        if grad is not None:
            flags.setdefault(grad.device, []).append(torch.logical_not(torch.isfinite(grad).all()))
    return any(bool(torch.stack(per_device).any()) for per_device in flags.values())


def _format_scale(scale: float) -> str:
    return str(int(scale)) if float(scale).is_integer() else f"{scale:g}"


_COUNTER_STATE: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("num_updates", "num_updates", int),
    ("overflow_count_since_report", "overflow_count_since_report", int),
    ("report_since_step", "_report_since_step", int),
)


class _OverflowCounter:
    """Counts update() calls and overflows, for the aggregated report; shared by both scalers."""

    scale: float
    STATE: ClassVar[tuple[tuple[str, str, Callable[[Any], Any]], ...]] = _COUNTER_STATE
    """(state_dict key, attribute, its type) of every value the scaler saves, in the saved order."""

    def __init__(self) -> None:
        self.num_updates = 0
        self.overflow_count_since_report = 0
        self._report_since_step = 0

    def _count(self, overflow: bool) -> None:
        self.num_updates += 1
        if overflow:
            self.overflow_count_since_report += 1

    def scale_loss(self, loss: Tensor) -> Tensor:
        """`loss * scale`, to call backward on."""
        return loss * self.scale

    def take_report(self) -> str | None:
        """One line about the overflow steps since the last report, or None when there were none; resets."""
        count, since = self.overflow_count_since_report, self._report_since_step
        self.overflow_count_since_report = 0
        self._report_since_step = self.num_updates
        if count == 0:
            return None
        noun = "step" if count == 1 else "steps"
        return f"fp16: {count} overflow {noun} skipped since step {since}; loss scale now {_format_scale(self.scale)}"

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, attribute) for key, attribute, _kind in self.STATE}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scale and counters; the configured settings (window, hysteresis, min_scale) stay."""
        for key, attribute, kind in self.STATE:
            setattr(self, attribute, kind(state_dict[key]))


class StaticLossScaler(_OverflowCounter):
    """A fixed scale (fp16.loss_scale > 0): update() only counts overflows for the report; never stuck."""

    STATE = (("scale", "scale", float), *_COUNTER_STATE)

    def __init__(self, scale: float) -> None:
        super().__init__()
        scale = float(scale)
        if not (scale > 0 and scale != float("inf")):
            raise ValueError(
                f"fp16.loss_scale={scale} is not a usable static loss scale; give a finite number > 0, "
                "or 0 for dynamic loss scaling"
            )
        self.scale = scale

    def update(self, overflow: bool) -> None:
        self._count(overflow)

    def stuck(self) -> bool:
        return False


class DynamicLossScaler(_OverflowCounter):
    """DeepSpeed's dynamic loss scale (see the module docstring for the rule), from a LossScalePlan."""

    STATE = (
        ("scale", "scale", float),
        ("cur_hysteresis", "cur_hysteresis", int),
        ("cur_iter", "cur_iter", int),
        ("last_overflow_iter", "last_overflow_iter", int),
        ("num_overflows_at_min", "num_overflows_at_min", int),
        *_COUNTER_STATE,
    )

    scale_factor = 2.0

    def __init__(self, plan: LossScalePlan) -> None:
        super().__init__()
        if plan.static_scale is not None:
            raise ValueError(
                f"DynamicLossScaler got a static plan (static_scale={plan.static_scale}); build it with "
                "make_loss_scaler(plan), which returns a StaticLossScaler for that case"
            )
        checks = {
            "fp16.loss_scale_window": (plan.window, plan.window >= 1),
            "fp16.hysteresis": (plan.hysteresis, plan.hysteresis >= 1),
            "fp16.min_loss_scale": (plan.min_scale, plan.min_scale > 0),
        }
        for key, (value, ok) in checks.items():
            if not ok:
                raise ValueError(f"{key}={value} is invalid; it must be >= 1 (window, hysteresis) or > 0 (min scale)")
        self.scale = float(2.0**plan.initial_scale_power)
        self.window = int(plan.window)
        self.min_scale = float(plan.min_scale)
        self.hysteresis = int(plan.hysteresis)
        self.consecutive_hysteresis = bool(plan.consecutive_hysteresis)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.num_overflows_at_min = 0
        """Consecutive update() calls that overflowed while the scale was already at min_scale."""

    def update(self, overflow: bool) -> None:
        """Apply one optimizer step's outcome to the scale and the hysteresis budget."""
        self._count(overflow)
        if overflow:
            at_min = self.scale <= self.min_scale
            self.num_overflows_at_min = self.num_overflows_at_min + 1 if at_min else 0
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            self.num_overflows_at_min = 0
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            clean_before = self.cur_iter - self.last_overflow_iter - 1
            if clean_before > 0 and clean_before % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.cur_iter += 1

    def at_minimum_for(self, steps: int) -> bool:
        """True when the last `steps` updates all overflowed with the scale already at min_scale."""
        return self.num_overflows_at_min >= steps

    def stuck(self) -> bool:
        """At the minimum scale and still overflowing for `window` steps in a row: training is not learning."""
        return self.at_minimum_for(self.window)


def make_loss_scaler(plan: LossScalePlan | None) -> StaticLossScaler | DynamicLossScaler | None:
    """None without fp16 loss scaling; a StaticLossScaler when the plan fixes the scale; else dynamic."""
    if plan is None:
        return None
    if plan.static_scale is not None:
        return StaticLossScaler(plan.static_scale)
    return DynamicLossScaler(plan)
