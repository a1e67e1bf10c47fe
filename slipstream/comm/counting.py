"""A counter of the collectives Slipstream issues: tests assert on it, the engine reports it per step."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass
class CollectiveCounter:
    """Calls and bytes per collective name ('all_reduce', 'reduce_scatter', 'all_gather', ...)."""

    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()


_ACTIVE: list[CollectiveCounter] = []


def record(op: str, tensor: torch.Tensor) -> None:
    """Count one collective in every active counter."""
    for counter in _ACTIVE:
        counter.record(op, tensor)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Count the collectives issued inside the block (nested blocks each count their own)."""
    counter = CollectiveCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)
