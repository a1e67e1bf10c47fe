"""DeepSpeed's `deepspeed.utils.timer.SynchronizedWallClockTimer` and `NoopTimer`: named wall-clock timers,
as Megatron-DeepSpeed drives them through `engine.timers` (`timers("forward").start()`, `.stop()`,
`timers.log(["forward"])`).

Each start and stop waits for the accelerator (its queued work counts in the interval it belongs to), so an
interval is host time around finished device work. `elapsed` is in milliseconds and, like DeepSpeed's, stops a
running timer for the reading and starts it again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

from slipstream.compat.runtime_utils import log_dist

__all__ = ["NoopTimer", "SynchronizedWallClockTimer"]


def _synchronize() -> None:
    from slipstream.accelerator import get_accelerator

    get_accelerator().synchronize()


class _Timer:
    """One named timer: the intervals between each start and stop since the last reset."""

    def __init__(self, name: str) -> None:
        self.name_ = name
        self.started_ = False
        self._start_s = 0.0
        self._intervals_s: list[float] = []

    def start(self) -> None:
        if self.started_:
            raise RuntimeError(f"timer {self.name_!r} is already running; stop() it before start()")
        _synchronize()
        self._start_s = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        del reset, record  # DeepSpeed's flags, unused by its own stop too
        if not self.started_:
            raise RuntimeError(f"timer {self.name_!r} is not running; start() it before stop()")
        _synchronize()
        self._intervals_s.append(time.perf_counter() - self._start_s)
        self.started_ = False

    def reset(self) -> None:
        self.started_ = False
        self._intervals_s.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds timed since the last reset (a running interval included up to now)."""
        running = self.started_
        if running:
            self.stop()
        total_ms = sum(self._intervals_s) * 1000.0
        if reset:
            self.reset()
        if running:
            self.start()
        return total_ms

    def mean(self) -> float:
        """Mean interval in milliseconds, the slowest and fastest tenth left out (DeepSpeed's trimmed mean)."""
        intervals = sorted(self._intervals_s)
        cut = int(len(intervals) * 0.1)
        kept = intervals[cut : len(intervals) - cut] or intervals
        return statistics.fmean(kept) * 1000.0 if kept else 0.0


class SynchronizedWallClockTimer:
    """Timers by name, created on first use."""

    Timer = _Timer

    def __init__(self) -> None:
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, _Timer]:
        return self.timers

    def log(
        self,
        names: Iterable[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: list[int] | None = None,
    ) -> None:
        """Log `time (ms) | name: ms/normalizer | ...` for the named timers that exist (rank 0 by default)."""
        del memory_breakdown
        if normalizer <= 0:
            raise ValueError(f"timers.log(normalizer={normalizer}): the normalizer must be > 0")
        parts = [f"{n}: {self.timers[n].elapsed(reset=reset) / normalizer:.2f}" for n in names if n in self.timers]
        log_dist(" | ".join(["time (ms)", *parts]), ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Each named timer's trimmed mean interval in milliseconds / normalizer."""
        if normalizer <= 0:
            raise ValueError(f"timers.get_mean(normalizer={normalizer}): the normalizer must be > 0")
        means = {n: self.timers[n].mean() / normalizer for n in names if n in self.timers}
        if reset:
            for name in means:
                self.timers[name].reset()
        return means


class _NoopTimerEntry:
    def start(self) -> None: ...

    def stop(self, reset: bool = False, record: bool = False) -> None: ...

    def reset(self) -> None: ...

    def elapsed(self, reset: bool = True) -> float:
        return 0.0

    def mean(self) -> float:
        return 0.0


class NoopTimer:
    """The same calls as SynchronizedWallClockTimer, timing nothing (the engine's timers without
    wall_clock_breakdown)."""

    Timer = _NoopTimerEntry

    def __init__(self) -> None:
        self.timer = _NoopTimerEntry()

    def __call__(self, name: str) -> _NoopTimerEntry:
        return self.timer

    def get_timers(self) -> dict[str, _Timer]:
        return {}

    def log(self, *args: object, **kwargs: object) -> None:
        """Logs nothing; takes SynchronizedWallClockTimer.log's arguments."""

    def get_mean(self, *args: object, **kwargs: object) -> dict[str, float]:
        """No timer, no mean; takes SynchronizedWallClockTimer.get_mean's arguments."""
        return {}
