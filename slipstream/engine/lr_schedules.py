"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Owns the per-iteration formulas and the optimizer writes; constructor signatures, formulas and state match
deepspeed/runtime/lr_schedules.py (the behaviour, re-derived here). Shared conventions:

- `last_batch_iteration` is the index of the last batch seen; -1 means "not started". Constructing with -1
  writes the schedule's starting lr into the optimizer (WarmupLR: warmup_min_lr, WarmupCosineLR: 0.0,
  OneCycle: cycle_min_lr, LRRangeTest: lr_range_test_min_lr); each `step()` advances the index by one.
- Warmup lengths are clamped to >= 2 and the log warmup uses gamma = log(it + 1) / log(warmup_num_steps).
- `state_dict()` is `{"last_batch_iteration": n}`; `load_state_dict` restores n, the next `step()` writes lrs.
- Min/max lrs may be one number (all groups) or one per parameter group.
- An unknown warmup_type warns and uses "log", as DeepSpeed does (its own tests pin this).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

Number = float | int
PerGroup = Number | Sequence[Number]
_WARMUP_TYPES = ("log", "linear")
_BETA2 = 0.99  # OneCycle writes betas (momentum, 0.99), as DeepSpeed does


def _torch_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer itself, or the one a wrapper holds in `.optimizer` (as DeepSpeed accepts)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(
        f"an LR schedule needs a torch.optim.Optimizer (or a wrapper with .optimizer), got {type(optimizer).__name__}"
    )


def _per_group(value: PerGroup, name: str, num_groups: int) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {num_groups} parameter "
                f"groups; give one number, or one per group"
            )
        return [float(v) for v in value]
    return [float(value)] * num_groups  # type: ignore[arg-type]


def _check_warmup(warmup_num_steps: object) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    return max(2, warmup_num_steps)


def _warmup_type(warmup_type: str) -> str:
    """'log' or 'linear'; anything else warns and gives 'log' (DeepSpeed's fallback)."""
    if warmup_type in _WARMUP_TYPES:
        return warmup_type
    warnings.warn(
        f"unknown warmup_type {warmup_type!r}: using 'log' (the known types are 'log' and 'linear')", stacklevel=4
    )
    return "log"


def _check_total(total_num_steps: object, warmup_num_steps: int) -> None:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, (int, float)) or total_num_steps < 0:
        raise ValueError(f"total_num_steps must be a non-negative number of optimizer steps, got {total_num_steps!r}")
    if total_num_steps < warmup_num_steps:
        warnings.warn(
            f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}: "
            "the schedule leaves warmup at its decayed end",
            stacklevel=3,
        )


class _Schedule:
    """Common state and optimizer writes; subclasses define `get_lr()` for `self.last_batch_iteration`."""

    def __init__(self, optimizer: object, last_batch_iteration: int) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _write(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep tensor lrs (capturable/compiled optimizers) tensors
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]

    def _advance(self, iteration: int | None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if iteration is None else iteration
        self._write(self.get_lr())

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next one) and write its lrs into the optimizer."""
        self._advance(last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer, one per parameter group."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr(): no lr has been written yet (the schedule "
                "was built with last_batch_iteration != -1); call step() first"
            )
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])


class _Warmup(_Schedule):
    """A schedule that starts with `warmup_num_steps` (checked; at least 2) of `warmup_type` warmup."""

    def __init__(self, optimizer: object, last_batch_iteration: int, warmup_num_steps: int, warmup_type: str) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)

    def _warmup_fraction(self, it: int) -> float:
        """0 at it=0, rising to 1 at it=warmup_num_steps (log: log(it+1)/log(W); linear: it/W)."""
        if self.warmup_type == "log":
            return math.log(it + 1) / math.log(self.warmup_num_steps)
        return it / self.warmup_num_steps


class WarmupLR(_Warmup):
    """Warm each group's lr from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold it.

    lr(it) = min + (max - min) * gamma(it), gamma = log(it+1)/log(W) or it/W while it < W, else 1.
    warmup_max_lr None means each group's own lr (DeepSpeed's default).
    """

    def __init__(
        self,
        optimizer: object,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration, warmup_num_steps, warmup_type)
        num_groups = len(self.optimizer.param_groups)
        if warmup_max_lr is None:  # each group's own lr (DeepSpeed 0.19)
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, "warmup_min_lr", num_groups)
        self.max_lrs = _per_group(warmup_max_lr, "warmup_max_lr", num_groups)
        self._check_total()
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def _check_total(self) -> None:
        """Hook for WarmupDecayLR; WarmupLR has no total."""

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return self._warmup_fraction(it)
        return self._after_warmup(it)

    def _after_warmup(self, it: int) -> float:
        """Gamma at step `it` once warmup is over: WarmupLR stays at the max."""
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps: gamma = max(0, (T - it) / max(1, T - W))."""

    def __init__(
        self,
        optimizer: object,
        total_num_steps: int,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _check_total(self) -> None:
        _check_total(self.total_num_steps, self.warmup_num_steps)

    def _after_warmup(self, it: int) -> float:
        return max(
            0.0, float(self.total_num_steps - it) / float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        )


class WarmupCosineLR(_Warmup):
    """Scale each group's original lr by a ratio: warmup from warmup_min_ratio to 1, then cosine to cos_min_ratio.

    warmup (it < W): r = m + (1 - m) * gamma(it); after: p = min(1, (it - W + 1) / max(1, T - W)),
    r = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2). Before the first step (it = -1) the lr is 0.
    """

    def __init__(
        self,
        optimizer: object,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration, warmup_num_steps, warmup_type)
        _check_total(total_num_steps, self.warmup_num_steps)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            gamma = self._warmup_fraction(it)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(_Schedule):
    """Grow each group's lr from lr_range_test_min_lr: lr = min_lr * (1 + rate * interval).

    interval = (it + 1) / step_size, floored when lr_range_test_staircase.
    """

    def __init__(
        self,
        optimizer: object,
        lr_range_test_min_lr: PerGroup = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(
                f"lr_range_test_step_size must be a positive number of steps, got {lr_range_test_step_size!r}"
            )
        self.min_lr = _per_group(lr_range_test_min_lr, "lr_range_test_min_lr", len(self.optimizer.param_groups))
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._write(self.min_lr)

    def get_lr(self) -> list[float]:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1.0 + self.step_rate * interval) for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance to `batch_iteration` (default: the next one); DeepSpeed's argument name for this class."""
        self._advance(batch_iteration)


class OneCycle(_Schedule):
    """1Cycle: lr rises cycle_min_lr -> cycle_max_lr over the first half-cycle, falls back over the second,
    then decays as min_lr / (1 + decay_lr_rate * (it - total + 1) / decay_step_size).

    Momentum (Adam betas[0], only for optimizers whose defaults have `betas`) moves inversely,
    cycle_max_mom -> cycle_min_mom -> cycle_max_mom, then max_mom * (1 + decay_mom_rate * interval).
    As in DeepSpeed, the betas written are (momentum, 0.99): beta2 is set to 0.99.
    """

    def __init__(
        self,
        optimizer: object,
        cycle_min_lr: PerGroup,
        cycle_max_lr: PerGroup,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if cycle_first_step_size <= 0:
            raise ValueError(f"cycle_first_step_size must be a positive number of steps, got {cycle_first_step_size!r}")
        if cycle_second_step_size is not None and cycle_second_step_size < 0:
            raise ValueError(
                f"cycle_second_step_size must be a non-negative number of steps or null, got {cycle_second_step_size!r}"
            )
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            float(cycle_second_step_size) if cycle_second_step_size is not None else self.first_step_size
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        num_groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, "cycle_min_lr", num_groups)
        self.max_lrs = _per_group(cycle_max_lr, "cycle_max_lr", num_groups)
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in self.optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(
                f"OneCycle: cycle_momentum is disabled because {type(self.optimizer).__name__} has no "
                "'betas' in its defaults",
                stacklevel=2,
            )
        self.min_moms = _per_group(cycle_min_mom, "cycle_min_mom", num_groups)
        self.max_moms = _per_group(cycle_max_mom, "cycle_max_mom", num_groups)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        if last_batch_iteration == -1:
            self._write(self.min_lrs)
            if self.cycle_momentum:
                self._write_betas([(mom, _BETA2) for mom in self.min_moms])

    def _scale_factor(self) -> float:
        """0 -> 1 over the first half-cycle and 1 -> 0 over the second, for batch index it + 1."""
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset in the cycle, not from `scale` (a float just under a stair).
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas per group for the current iteration, (momentum, 0.99) as DeepSpeed returns them, or None
        when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            moms = [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        elif self.skip_mom_decay:
            moms = list(self.max_moms)
        else:
            factor = 1.0 + self.decay_mom_rate * self._decay_interval()
            moms = [hi * factor for hi in self.max_moms]
        return [(mom, _BETA2) for mom in moms]

    def _write_betas(self, betas: Sequence[tuple[float, float]]) -> None:
        for group, pair in zip(self.optimizer.param_groups, betas):
            group["betas"] = pair

    def step(self, batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance to `batch_iteration` (default: the next one); writes lrs and, if cycled, betas."""
        self._advance(batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._write_betas(moms)


SCHEDULES: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
