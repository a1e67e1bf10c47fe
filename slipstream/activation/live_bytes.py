"""Counting the memory that saved activations hold, storage by storage, until it is really freed.

A tensor's Python object can die while autograd (or a `detach()` alias) still uses its memory, so the count
follows the untyped storage: it drops when the last tensor on that storage is gone. `counting_saved(meter)`
counts every tensor autograd saves inside the block (the reference a run without activation offload is
measured by)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

__all__ = ["LiveBytes", "counting_saved"]


class LiveBytes:
    """Bytes of the tracked storages still alive (`current`) and the most at any time (`peak`)."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._alive: set[int] = set()

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage until it is freed (once, however often it is tracked)."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._alive or storage.nbytes() == 0:
            return
        self._alive.add(key)
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._freed, key, storage.nbytes())

    def reset_peak(self) -> None:
        self.peak = self.current

    def _freed(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.current -= nbytes


@contextlib.contextmanager
def counting_saved(meter: LiveBytes) -> Iterator[LiveBytes]:
    """Track every tensor autograd saves for backward inside the block; the tensors themselves are kept."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        meter.track(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield meter
