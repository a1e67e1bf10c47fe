"""A pool of flat scratch buffers (gather and reduce-scatter staging), allocated once and reused.

Units of the same size (the blocks of a transformer) share buffers: a buffer taken for one collective
goes back to the pool when the collective's result has been consumed, and the next unit reuses it. On
these machines re-allocating large buffers every step costs page faults (docs/design.md P16);
the pool keeps at most as many buffers per size as were ever in use at once.
"""

from __future__ import annotations

import collections

import torch


class BufferPool:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
        self._bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(numel, dtype)]
        if free:
            return free.pop()
        tensor = torch.empty(numel, dtype=dtype, device=self.device)
        self._bytes += tensor.numel() * tensor.element_size()
        return tensor

    def give(self, tensor: torch.Tensor) -> None:
        self._free[(tensor.numel(), tensor.dtype)].append(tensor)

    def free_buffers(self) -> list[torch.Tensor]:
        """The buffers not taken now (between steps: all of them)."""
        return [tensor for free in self._free.values() for tensor in free]

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every buffer the pool ever allocated (taken or free)."""
        return self._bytes
