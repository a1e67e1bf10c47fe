"""A counter of the collectives Slipstream issues: tests assert on it, the engine reports it per step."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist


@dataclasses.dataclass(eq=False)  # by identity: nested counters with equal counts are still different counters
class CollectiveCounter:
    """Calls and bytes per collective name ('all_reduce', 'reduce_scatter', 'all_gather', ...)."""

    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    seconds: collections.defaultdict[str, float] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(float)
    )
    """Time from issue to completion, for the collectives that were waited on (all but abandoned ones)."""
    dtype_bytes: collections.Counter[tuple[str, str]] = dataclasses.field(default_factory=collections.Counter)
    """Bytes per (collective name, dtype name: 'float32', 'bfloat16', ...)."""
    group_bytes: collections.Counter[tuple[str, tuple[int, ...]]] = dataclasses.field(
        default_factory=collections.Counter
    )
    """Bytes per (collective name, global ranks of the process group it ran on)."""
    listener: Callable[[str, int, str], None] | None = None
    """Called with (op, bytes, call site) as each collective is issued (the comms logger's verbose mode)."""

    def record(self, op: str, tensor: torch.Tensor, site: str = "", ranks: tuple[int, ...] = ()) -> None:
        size = tensor.numel() * tensor.element_size()
        self.calls[op] += 1
        self.bytes[op] += size
        if ranks:
            self.group_bytes[(op, ranks)] += size
        self.dtype_bytes[(op, str(tensor.dtype).removeprefix("torch."))] += size
        if self.listener is not None:
            self.listener(op, size, site)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.group_bytes.clear()
        self.dtype_bytes.clear()
        self.seconds.clear()


_ACTIVE: list[CollectiveCounter] = []


def record(op: str, tensor: torch.Tensor, site: str = "", group: dist.ProcessGroup | None = None) -> None:
    """Count one collective in every active counter; `group`: the process group it runs on (None: the world)."""
    if not _ACTIVE:
        return
    ranks = _group_ranks(group)
    for counter in _ACTIVE:
        counter.record(op, tensor, site, ranks)


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of `group` (None: the default group); () when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def record_time(op: str, seconds: float) -> None:
    """Add the time one collective took, from issue to completion, to every active counter."""
    for counter in _ACTIVE:
        counter.seconds[op] += seconds


def start(counter: CollectiveCounter) -> None:
    """Count into `counter` until `stop(counter)` (a counter that outlives one block: the comms logger's)."""
    _ACTIVE.append(counter)


def stop(counter: CollectiveCounter) -> None:
    if counter in _ACTIVE:
        _ACTIVE.remove(counter)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Count the collectives issued inside the block (nested blocks each count their own)."""
    counter = CollectiveCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)
