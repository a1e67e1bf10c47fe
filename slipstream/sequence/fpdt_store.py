"""Where FPDT's finished chunks wait for the backward pass: on the device (`DeviceChunks`) or in host memory
(`HostChunks`, Ulysses-Offload).

[Note: FPDT chunk store] Chunked attention (fpdt_attention.py) keeps, per sequence chunk, the head-sharded q, k
and v, the attention output and its log-sum-exp; its backward adds the output gradient, its row sums and the
query-gradient accumulators. A chunk is `put` once finished and `get` when a later step needs it:

- `DeviceChunks` keeps the tensor itself; `get` returns it (no copy).
- `HostChunks` copies it into a host buffer (pinned through the accelerator) and lets the device tensor go;
  `get` copies it back into a fresh device tensor that lives only while the caller uses it, so the device holds
  O(chunk) of these tensors at a time instead of O(sequence). Host buffers come from a pool owned by the store
  and are reused across steps: a call takes buffers when it saves and gives them all back when its backward is
  done (or its graph is dropped), so two calls in flight never share one. Copies are issued on the current
  stream (non-blocking from pinned memory), which orders them after the work that produced the chunk and
  before the work that reads it back.

On a CPU-only machine "host" and "device" are the same memory: the copies still happen and are counted.
`stats` is activation offload's record (activation/offload.py): chunks offloaded, fetched, host buffers
allocated; `stats.device_bytes` counts the device-resident tensors the store holds or hands out (storage by storage,
until freed): the memory that saved chunks cost the device.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from slipstream.accelerator import get_accelerator
from slipstream.activation.offload import StoreStats

__all__ = ["ChunkSession", "ChunkStore", "DeviceChunks", "HostChunks"]


@dataclasses.dataclass(frozen=True)
class _Held:
    tensor: torch.Tensor
    """The saved chunk itself (device) or its host copy."""
    device: torch.device
    """Where the chunk is used."""


class ChunkSession:
    """The saved chunks of one attention call, by (kind, chunk index); see [Note: FPDT chunk store]."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._held: dict[tuple[str, int], _Held] = {}

    def put(self, kind: str, index: int, tensor: torch.Tensor) -> None:
        self._held[(kind, index)] = self.store.hold(self, (kind, index), tensor)

    def get(self, kind: str, index: int) -> torch.Tensor:
        held = self._held.get((kind, index))
        if held is None:
            raise RuntimeError(f"FPDT chunk store: no saved {kind!r} for chunk {index} (backward run twice?)")
        return self.store.bring_back(held, (kind, index))

    def drop(self, index: int, *kinds: str) -> None:
        """Release the saved `kinds` of chunk `index` early (no later step needs them)."""
        for kind in kinds:
            self._held.pop((kind, index), None)

    def close(self) -> None:
        """Release every saved chunk (host buffers go back to the pool)."""
        self._held.clear()
        self.store.release(self)


class ChunkStore:
    """Holds finished chunks for the backward pass; subclasses say where."""

    def __init__(self) -> None:
        self.stats = StoreStats()

    def session(self) -> ChunkSession:
        return ChunkSession(self)

    def hold(self, session: ChunkSession, key: tuple[str, int], tensor: torch.Tensor) -> _Held:
        raise NotImplementedError

    def bring_back(self, held: _Held, key: tuple[str, int]) -> torch.Tensor:
        raise NotImplementedError

    def release(self, session: ChunkSession) -> None:
        """Nothing to give back by default."""


class DeviceChunks(ChunkStore):
    """Saved chunks stay where they were computed."""

    def hold(self, session: ChunkSession, key: tuple[str, int], tensor: torch.Tensor) -> _Held:
        self.stats.device_bytes.track(tensor)
        return _Held(tensor, tensor.device)

    def bring_back(self, held: _Held, key: tuple[str, int]) -> torch.Tensor:
        return held.tensor


class HostChunks(ChunkStore):
    """Saved chunks wait in reused (pinned) host buffers; see [Note: FPDT chunk store]."""

    def __init__(self) -> None:
        super().__init__()
        self._free: list[torch.Tensor] = []  # host byte buffers no call holds
        self._taken: dict[int, dict[tuple[str, int], torch.Tensor]] = {}  # session id -> its buffers

    def hold(self, session: ChunkSession, key: tuple[str, int], tensor: torch.Tensor) -> _Held:
        buffers = self._buffers_of(session)
        nbytes = tensor.numel() * tensor.element_size()
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            if buffer is not None:
                self._free.append(buffer)
            buffer = buffers[key] = self._take_free(nbytes)
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor.detach(), non_blocking=True)
        self.stats.offloaded += 1
        return _Held(host, tensor.device)

    def bring_back(self, held: _Held, key: tuple[str, int]) -> torch.Tensor:
        restored = torch.empty(held.tensor.shape, dtype=held.tensor.dtype, device=held.device)
        restored.copy_(held.tensor, non_blocking=True)
        self.stats.device_bytes.track(restored)
        self.stats.fetched_on_demand += 1  # brought back when the pair that needs it runs
        return restored

    def release(self, session: ChunkSession) -> None:
        self._forget(id(session))

    def _buffers_of(self, session: ChunkSession) -> dict[tuple[str, int], torch.Tensor]:
        key = id(session)
        if key not in self._taken:
            self._taken[key] = {}
            weakref.finalize(session, self._forget, key)  # a graph dropped before its backward
        return self._taken[key]

    def _forget(self, key: int) -> None:
        self._free.extend(self._taken.pop(key, {}).values())

    def _take_free(self, nbytes: int) -> torch.Tensor:
        """The smallest free host buffer of at least `nbytes`, else a new one."""
        fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fitting:
            return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        self.stats.host_allocations += 1
        return get_accelerator().pin_memory(torch.empty(nbytes, dtype=torch.uint8))
