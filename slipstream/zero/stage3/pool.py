"""A pool of flat buffers, allocated once and reused: the scratch of the collectives (gather rows, reduce-scatter
staging) and the memory behind the units' gathered values.

Units of the same size (the blocks of a transformer) share buffers: a buffer taken for one collective
goes back to the pool when the collective's result has been consumed, and the next unit reuses it. On
these machines re-allocating large buffers every step costs page faults (docs/design.md P16);
the pool keeps at most as many buffers per size as were ever in use at once.

[Note: lent gathered memory]
A unit's gathered values live in one storage for the unit's whole life: the parameters are views of it, and so
are the tensors autograd saves in the forward, which must see the values again when the backward gathers the unit
once more. Releasing the unit empties that storage and a gather fills it again. Growing it with `resize_` would
allocate fresh memory at every gather, and on the host every page of that memory faults on its first write (the
gather's unpack), a sixth of a step on a model of wide layers. Instead `lend` swaps the memory of a pooled buffer
of the unit's size into the empty storage (torch keeps the storage object, so every view stays valid), and
`reclaim` swaps it back at the release: the memory is touched once, then reused by every gather of every unit
of that size. The pool holds as many of these buffers per size as were ever gathered at once (what the
prefetch and the live-parameter limit allow), so the peak is the one the gathers always had; between steps the
buffers stay allocated, ready for the next forward. `drop_idle` frees those not lent (the engine's `empty_partition_cache`).
"""

from __future__ import annotations

import collections

import torch

from slipstream.utils.torch_shim import CAN_SWAP_STORAGE_MEMORY, swap_storage_memory

_Key = tuple[int, torch.dtype]


class BufferPool:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[_Key, list[torch.Tensor]] = collections.defaultdict(list)
        self._bytes = 0
        self._idle_memory: dict[_Key, list[torch.Tensor]] = collections.defaultdict(list)
        self._memory_bytes = 0

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
        """The buffers not taken now (between steps: all of them), the idle gathered memory included."""
        return [tensor for free in (*self._free.values(), *self._idle_memory.values()) for tensor in free]

    # ---- gathered memory: see [Note: lent gathered memory] ----
    def lend(self, full: torch.Tensor) -> torch.Tensor | None:
        """Give `full`'s empty storage (a unit's gathered buffer after its release: 0 bytes) the memory of a pooled
        buffer of its size. Returns the buffer, now empty, for `reclaim`; None where torch cannot swap storages
        (then `full`'s storage is grown in place, as a plain resize)."""
        if not CAN_SWAP_STORAGE_MEMORY:
            full.untyped_storage().resize_(full.numel() * full.element_size())
            return None
        idle = self._idle_memory[(full.numel(), full.dtype)]
        if idle:
            buffer = idle.pop()
        else:
            buffer = torch.empty(full.numel(), dtype=full.dtype, device=self.device)
            self._memory_bytes += buffer.numel() * buffer.element_size()
        swap_storage_memory(full, buffer)
        return buffer

    def reclaim(self, full: torch.Tensor, buffer: torch.Tensor) -> None:
        """The unit is released: its memory goes back to the pool (into `buffer`, from `lend`) and `full`'s storage
        is empty again."""
        swap_storage_memory(full, buffer)
        self._idle_memory[(buffer.numel(), buffer.dtype)].append(buffer)

    def forget(self, buffer: torch.Tensor) -> None:
        """The memory lent with `buffer` stays with tensors that alias the unit's old storage (user code kept them
        past the release): the pool lets it go, and allocates again when a gather needs it."""
        self._memory_bytes -= buffer.numel() * buffer.element_size()

    def drop_idle(self) -> None:
        """Free the gathered memory no unit holds now."""
        for idle in self._idle_memory.values():
            self._memory_bytes -= sum(b.numel() * b.element_size() for b in idle)
            idle.clear()

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every scratch buffer the pool ever allocated (taken or free)."""
        return self._bytes

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered memory the pool holds, lent to units or idle."""
        return self._memory_bytes
