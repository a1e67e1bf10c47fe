"""How much host memory this process has pinned (DeepSpeed's `deepspeed.utils.pin_memory_tracker`).

Pinned (page-locked) memory cannot be swapped out and counts against the memlock limit (`ulimit -l`), so a
host running out of memory is often explained by how much of it was pinned, far from where that happened.
Every accelerator's `pin_memory` that really pins (CUDA/ROCm; offloaded optimizer state and ZeRO-3 host
shards go through it) calls `track_pinned_memory(nbytes)`. The running total is logged at debug level on
each call, at info level each time it first reaches 32 GiB, 64 GiB, 128 GiB, ... (a few milestones, not one
line per tensor), and on demand with `pinned_memory_summary(tag)`.

The module-level `_tracker` and `_fmt_bytes` keep DeepSpeed's names: its tests and tools read them.
"""

from __future__ import annotations

from slipstream.utils.logging import get_logger

__all__ = ["pinned_memory_summary", "track_pinned_memory"]

_GIB = 1024**3
FIRST_MILESTONE = 32 * _GIB
"""The first total logged at info level; each next one is twice the last."""


def _fmt_bytes(num_bytes: int) -> str:
    """512 -> "512 B", 2048 -> "2.0 KB", 2**20 -> "1.00 MB", 2**30 -> "1.000 GB" (more digits for bigger units)."""
    for unit, size, digits in (("GB", _GIB, 3), ("MB", 1024**2, 2), ("KB", 1024, 1)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{digits}f} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    """The process-wide total: bytes pinned, calls counted, and the next milestone to log."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything tracked so far (and start the milestones again at 32 GiB)."""
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = FIRST_MILESTONE

    def track(self, num_bytes: int) -> None:
        """Add one pinning of `num_bytes`; log every milestone the total has now reached."""
        self._bytes += int(num_bytes)
        self._calls += 1
        logger = get_logger()
        logger.debug(
            "pin_memory: +%s (call %d, %s pinned in all)", _fmt_bytes(num_bytes), self._calls, _fmt_bytes(self._bytes)
        )
        while self._bytes >= self._next_checkpoint:
            logger.info(
                "pinned-memory checkpoint: crossed %s; %s pinned in %d allocations",
                _fmt_bytes(self._next_checkpoint),
                _fmt_bytes(self._bytes),
                self._calls,
            )
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        """Log the total at info level, prefixed with `tag` when given."""
        where = f" {tag}" if tag else ""
        get_logger().info("pinned memory%s: %s in %d allocations", where, _fmt_bytes(self._bytes), self._calls)


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    """Count `num_bytes` of newly pinned host memory in the process-wide total."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the process-wide pinned total (`tag` says where in the program this is)."""
    _tracker.log_summary(tag)
