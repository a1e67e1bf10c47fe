"""Where the inputs saved at checkpoint boundaries wait for the backward pass.

`CheckpointStore.hooks()` wraps a checkpointed call (slipstream.checkpointing.checkpoint): torch's
non-reentrant checkpoint saves the call's inputs for the recomputation, and the store takes each of them
out of the autograd graph:

- `to_host` (activation offload, `cpu_checkpointing`): the input is copied into a host buffer on the
  accelerator's copy stream, after the producer's work (the stream waits for the compute stream), and the
  graph keeps only the host copy, so the device memory is freed once nothing else holds it. In the backward
  pass, unpacking input k (its recomputation starting) starts the copy back of input k-1 on the copy stream:
  each input is on the device again before the recomputation that needs it; the compute stream waits for
  the copy's event. Host buffers are pinned, one per input ordinal of a step, allocated once and reused
  (grown only when a later step needs more).
- `contiguous` (`contiguous_memory_optimization` with `number_checkpoints`): the inputs of a step are packed
  into one buffer per dtype, allocated once for `number_checkpoints` times the first input's size (on the
  host when offloading, else on the input's device), so they do not fragment the allocator.

A step's slots are reused once every input of the previous step is released by autograd (its backward done
or its graph dropped). On a CPU-only machine "host" and "device" are the same memory: the mechanism runs
(copies, releases, prefetches, counts), but it frees nothing that a host copy does not take back.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.accelerator.base import EventLike, StreamLike
from slipstream.activation.live_bytes import LiveBytes

__all__ = ["CheckpointStore", "StoreStats"]


@dataclasses.dataclass
class StoreStats:
    """What the store did (cumulative) and the device bytes of checkpointed inputs it saw alive."""

    offloaded: int = 0
    """Inputs copied to host memory."""
    prefetched: int = 0
    """Inputs brought back ahead of the unpack that needed them."""
    fetched_on_demand: int = 0
    """Inputs brought back only when unpacked (the first of each backward, or after a prefetch was missed)."""
    host_allocations: int = 0
    """Host (or contiguous) buffers allocated; stays flat once the steps repeat."""
    device_bytes: LiveBytes = dataclasses.field(default_factory=LiveBytes)
    """Device-resident checkpointed inputs: the originals from their save, the restored copies from their fetch."""


class _Slot:
    """One saved input: where it waits (`held`), and its device copy once fetched (`ready`)."""

    __slots__ = ("__weakref__", "device", "dtype", "event", "held", "ordinal", "ready", "shape", "taken")

    def __init__(self, ordinal: int, tensor: torch.Tensor, held: torch.Tensor) -> None:
        self.ordinal, self.shape, self.dtype, self.device = ordinal, tensor.shape, tensor.dtype, tensor.device
        self.held = held
        self.ready: torch.Tensor | None = None
        self.event: EventLike | None = None
        self.taken = False


class CheckpointStore:
    """Saved-tensor hooks that offload and/or pack the inputs of checkpointed calls (see the module doc)."""

    def __init__(self, *, to_host: bool, contiguous: bool, number_checkpoints: int | None) -> None:
        if contiguous and (number_checkpoints is None or number_checkpoints < 1):
            raise ValueError(
                "activation_checkpointing.contiguous_memory_optimization needs number_checkpoints (got "
                f"{number_checkpoints!r}): set it to the number of checkpointed calls per forward pass"
            )
        self.to_host, self.contiguous, self.number_checkpoints = to_host, contiguous, number_checkpoints
        self.stats = StoreStats()
        self._host: list[torch.Tensor] = []  # per-ordinal host buffers (bytes), reused across steps
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # contiguous buffers
        self._used: dict[tuple[torch.dtype, torch.device], int] = {}
        self._slots: list[weakref.ref[_Slot]] = []
        self._live = 0
        self._stream: StreamLike | None = None

    @property
    def active(self) -> bool:
        return self.to_host or self.contiguous

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def release(self) -> None:
        """Drop the buffers (`slipstream.checkpointing.reset()`); live slots keep theirs until released."""
        self._host, self._flat, self._used = [], {}, {}

    # ---- forward: save ----
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Slot:
        if isinstance(tensor, nn.Parameter) or tensor.numel() == 0:
            return tensor  # alive anyway, or nothing to move (torch 2.4's checkpoint saves an empty marker)
        if self._live == 0:
            self._slots.clear()
            self._used = dict.fromkeys(self._used, 0)
        self.stats.device_bytes.track(tensor)
        slot = _Slot(len(self._slots), tensor, self._destination(len(self._slots), tensor))
        stream = self._copy_stream(tensor) if self.to_host else None  # a device-side pack stays in order
        _copy(stream, slot.held, tensor, source_used_on_copy_stream=True)
        self.stats.offloaded += int(self.to_host)
        self._slots.append(weakref.ref(slot))
        self._live += 1
        weakref.finalize(slot, self._released)
        return slot

    def _released(self) -> None:
        self._live -= 1

    def _destination(self, ordinal: int, tensor: torch.Tensor) -> torch.Tensor:
        """A view shaped like `tensor` in the buffer where it waits."""
        if self.contiguous:
            return self._contiguous_view(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        while len(self._host) <= ordinal:
            self._host.append(torch.empty(0, dtype=torch.uint8))
        if self._host[ordinal].numel() < nbytes:
            self._host[ordinal] = self._allocate(nbytes, torch.uint8, torch.device("cpu"))
        return self._host[ordinal][:nbytes].view(tensor.dtype).view(tensor.shape)

    def _contiguous_view(self, tensor: torch.Tensor) -> torch.Tensor:
        device = torch.device("cpu") if self.to_host else tensor.device
        key = (tensor.dtype, device)
        if key not in self._flat:
            assert self.number_checkpoints is not None  # checked in __init__
            self._flat[key] = self._allocate(self.number_checkpoints * tensor.numel(), tensor.dtype, device)
            self._used[key] = 0
            if device.type == tensor.device.type and not self.to_host:
                self.stats.device_bytes.track(self._flat[key])
        flat, start = self._flat[key], self._used[key]
        if start + tensor.numel() > flat.numel():
            raise ValueError(
                f"activation_checkpointing.number_checkpoints={self.number_checkpoints}: the contiguous buffer "
                f"for {tensor.dtype} holds {flat.numel()} elements (number_checkpoints x the first checkpointed "
                f"input), and this step's checkpointed inputs need {start + tensor.numel()} or more; set "
                "number_checkpoints to the number of checkpointed calls per forward pass"
            )
        self._used[key] = start + tensor.numel()
        return flat[start : start + tensor.numel()].view(tensor.shape)

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.stats.host_allocations += 1
        buffer = torch.empty(numel, dtype=dtype, device=device)
        return get_accelerator().pin_memory(buffer) if device.type == "cpu" else buffer

    # ---- backward: restore ----
    def _unpack(self, packed: torch.Tensor | _Slot) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if not self.to_host:
            return packed.held  # packed into the device's contiguous buffer: used in place
        if packed.ready is None:
            self._fetch(packed)
            self.stats.fetched_on_demand += 1
        tensor = self._take(packed)
        self._prefetch_before(packed.ordinal)
        return tensor

    def _prefetch_before(self, ordinal: int) -> None:
        """Start bringing back the input saved before `ordinal`: the next one this backward pass needs."""
        for earlier in reversed(self._slots[:ordinal]):
            slot = earlier()
            if slot is None or slot.taken:
                continue
            if slot.ready is None:
                self._fetch(slot)
                self.stats.prefetched += 1
            return

    def _fetch(self, slot: _Slot) -> None:
        restored = torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)
        slot.event = _copy(self._copy_stream(restored), restored, slot.held, source_used_on_copy_stream=False)
        self.stats.device_bytes.track(restored)
        slot.ready = restored

    def _take(self, slot: _Slot) -> torch.Tensor:
        restored, event = slot.ready, slot.event
        assert restored is not None  # fetched just before
        slot.ready, slot.event, slot.taken = None, None, True
        if event is not None:
            current = get_accelerator().current_stream()
            event.wait(current)  # type: ignore[attr-defined]
            restored.record_stream(current)  # type: ignore[arg-type]
        return restored

    def _copy_stream(self, tensor: torch.Tensor) -> StreamLike | None:
        """The accelerator's copy stream for a tensor on a device with streams; None (copy inline) on the host."""
        if tensor.device.type == "cpu":
            return None
        if self._stream is None:
            self._stream = get_accelerator().Stream()
        return self._stream


def _copy(
    stream: StreamLike | None, dest: torch.Tensor, source: torch.Tensor, *, source_used_on_copy_stream: bool
) -> EventLike | None:
    """`dest.copy_(source)`, on `stream` after the compute stream's queued work when there is one; returns
    the copy's event then (None for an inline copy)."""
    if stream is None:
        dest.copy_(source)
        return None
    accelerator = get_accelerator()
    stream.wait_stream(accelerator.current_stream())
    with accelerator.stream(stream):
        dest.copy_(source, non_blocking=True)
        event = accelerator.Event()
        event.record(stream)
    held: Callable[..., None] = (source if source_used_on_copy_stream else dest).record_stream
    held(stream)  # the allocator keeps the device memory until the copy is done
    return event
