"""DeepSpeed's `deepspeed.monitor.monitor`: `Monitor` (the interface) and `MonitorMaster`, the object behind
`engine.monitor` that fans `write_events([(name, value, step), ...])` out to the enabled monitors.

The monitors themselves are Slipstream's (csv, tensorboard, wandb, comet: slipstream/monitor/writers.py); the
engine writes its own events through them at every step, and `engine.monitor.write_events` adds the caller's
(Megatron-DeepSpeed writes its own loss and timing events this way).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

__all__ = ["Monitor", "MonitorMaster"]


class Monitor:
    """DeepSpeed's monitor interface: built from its config, writes `(name, value, step)` events."""

    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    def write_events(self, event_list: Iterable[tuple[str, float, int]]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.write_events: a Monitor subclass must define it")


class MonitorMaster(Monitor):
    """All enabled monitors of one job. `monitor_config` is the engine's `plan.logging.monitor` (a
    MonitorPlan) or None; `monitors` gives already-built ones instead (the engine's, on rank 0)."""

    def __init__(self, monitor_config: Any, *, monitors: list[Any] | None = None) -> None:
        super().__init__(monitor_config)
        if monitors is None:
            monitors = [] if monitor_config is None or _rank() != 0 else _build(monitor_config)
        self.monitors = monitors
        self.enabled = bool(monitors)

    def write_events(self, event_list: Iterable[tuple[str, float, int]]) -> None:
        """Write each `(name, value, step)`; events of one step go out together."""
        by_step: dict[int, dict[str, float]] = defaultdict(dict)
        for name, value, step in event_list:
            by_step[int(step)][name] = float(value)
        for step, events in by_step.items():
            for monitor in self.monitors:
                monitor.write(events, step)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _build(monitor_config: Any) -> list[Any]:
    from slipstream.monitor.writers import make_monitors

    return make_monitors(monitor_config)
