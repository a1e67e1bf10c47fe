"""The abstract device API: what the engine may ask of a device, with DeepSpeed's method names.

This module owns the `Accelerator` base class and the small structural types (`StreamLike`,
`EventLike`) its stream/event methods return. Concrete backends live next door (`cpu.py`, `cuda.py`,
`mps.py`); choosing one is `registry.py`'s job. Nothing here imports a device runtime.

Methods that only depend on the backend's name or on other methods (`name`, `device`,
`current_device_name`, `supported_dtypes`, `on_accelerator`, `set_visible_devices_envs`,
`op_builder_dir`, compile backend, `memory_cached`, `reset_max_memory_allocated`) are implemented here once; everything that talks to
a device runtime is abstract.

Deliberate differences from DeepSpeed's `DeepSpeedAccelerator`:
- `device(i)` returns a `torch.device` (DeepSpeed's CUDA backend returns the `torch.cuda.device` context
  manager there; its CPU backend returns a `torch.device`). Use `set_device` to change the current device.
- `pin_memory(tensor, align_bytes=1)` keeps DeepSpeed's newer signature; no `make_copy`/`match_shape`.
- Graphs (`create_graph`, ...), legacy tensor constructors (`FloatTensor`, ...) and op-builder factories
  (`create_op_builder`, `get_op_builder`) are not part of this first slice.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

import torch

DEFAULT_COMPILE_BACKEND = "inductor"
"""What `get_compile_backend()` returns until `set_compile_backend()` is called (as in DeepSpeed)."""


class StreamLike(Protocol):
    """What callers may do with streams from `current_stream()`, `Stream()` (torch.cuda.Stream's subset)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def wait_stream(self, stream: StreamLike) -> None: ...


class EventLike(Protocol):
    """What callers may do with an `Event(...)` object (torch.cuda.Event's subset)."""

    def record(self, stream: StreamLike | None = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: EventLike) -> float: ...


class Accelerator(abc.ABC):
    """One kind of device (cpu, cuda, mps) as the engine sees it.

    Subclasses set the class attribute `_name` (also the `torch.device` type string) and
    `_communication_backend_name`. Instances are cheap and must not touch the device in `__init__`,
    so constructing one never initialises a device runtime.
    """

    _name: str = ""
    _communication_backend_name: str = ""

    def __init__(self) -> None:
        self._compile_backend: str = DEFAULT_COMPILE_BACKEND

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r})"

    # ------------------------------------------------------------------ identity and devices
    @property
    def name(self) -> str:
        """The device type string, e.g. "cpu" or "cuda" (same as `_name`)."""
        return self._name

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this kind of device can be used in this process."""

    def device_name(self, device_index: int | None = None) -> str:
        """The device string for `torch.device`: `_name`, or `_name:index` ("cuda", "cuda:1")."""
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        """A `torch.device` for `device_index` (the backend's generic device when None)."""
        return torch.device(self.device_name(device_index))

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make `device_index` this process's current device."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of this process's current device."""

    def current_device_name(self) -> str:
        """Device string of the current device, e.g. "cuda:0"."""
        return self.device_name(self.current_device())

    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind one node offers to local ranks."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Block the host until queued work on the device has finished."""

    def is_synchronized_device(self) -> bool:
        """True when device work runs synchronously with the host (no queues, no streams): False here, for the
        devices with queues; the CPU says True."""
        return False

    def use_host_timers(self) -> bool:
        """Whether wall-clock host timers measure device work (true for synchronous devices)."""
        return self.is_synchronized_device()

    def has_streams(self) -> bool:
        """Whether `Stream()` makes a real queue that work can be put on beside the current one (so a second
        stream can overlap communication with compute): True for devices with queues."""
        return not self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether ordering between streams is implicit, so no stream waits are needed."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether the device never needs explicit synchronisation to bound queued allocations."""
        return self.is_synchronized_device()

    # ------------------------------------------------------------------ RNG
    def random(self) -> ModuleType:
        """The `torch.random` module (DeepSpeed returns it for every backend)."""
        return torch.random

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of all devices of this kind."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed the current device's generator was last seeded with."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """A copy of the generator state (a uint8 tensor) of `device_index` (current when None)."""

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a state returned by `get_rng_state`."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """The default `torch.Generator` of device `device_index`."""

    # ------------------------------------------------------------------ streams and events
    @property
    @abc.abstractmethod
    def Stream(self) -> type[StreamLike]:
        """The stream class; `Stream()` makes a new stream."""

    @abc.abstractmethod
    def stream(self, stream: StreamLike | None) -> contextlib.AbstractContextManager[object]:
        """Context manager that makes `stream` current inside the block."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> StreamLike:
        """The stream work is queued on now."""

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> StreamLike:
        """The device's default stream."""

    @property
    @abc.abstractmethod
    def Event(self) -> type[EventLike]:
        """The event class; `Event(enable_timing=True)` makes a timing event."""

    # ------------------------------------------------------------------ memory (bytes)
    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused memory to the system where the backend caches."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes currently in use (see each backend for what "in use" means)."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of `memory_allocated` since start or the last reset."""

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart peak tracking from the current value: `reset_peak_memory_stats`, whose peaks include this one
        (as torch.cuda.reset_max_memory_allocated does)."""
        self.reset_peak_memory_stats(device_index)

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the backend's allocator (used plus cached)."""

    def memory_cached(self, device_index: int | None = None) -> int:
        """Old DeepSpeed name for `memory_reserved`."""
        return self.memory_reserved(device_index)

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        """Allocator statistics, keyed like `torch.cuda.memory_stats` where the backend can."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Reset every peak in `memory_stats` (includes `max_memory_allocated`)."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """Total bytes of device memory."""

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes that could still be allocated now."""

    # ------------------------------------------------------------------ dtypes
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 training is supported."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 training is supported."""

    def supported_dtypes(self) -> list[torch.dtype]:
        """float32, then bfloat16 and float16 where supported (DeepSpeed's order)."""
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # ------------------------------------------------------------------ tensors
    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy of host `tensor` for fast device copies, or `tensor` where pinning is moot."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in page-locked host memory."""

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on a device of this kind."""
        return tensor.device.type == self._name

    # ------------------------------------------------------------------ launch and communication
    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device ("gloo", "nccl")."""
        return self._communication_backend_name

    @abc.abstractmethod
    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict which devices a process sees."""

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Write `local_accelerator_ids` (comma-joined) into every variable of `visible_devices_envs()`."""
        value = ",".join(str(i) for i in local_accelerator_ids)
        for env in self.visible_devices_envs():
            current_env[env] = value

    @abc.abstractmethod
    def export_envs(self) -> list[str]:
        """Prefixes of environment variables the launcher forwards to other nodes."""

    # ------------------------------------------------------------------ profiling, init, ops, compile
    @abc.abstractmethod
    def range_push(self, msg: str) -> None:
        """Open a named profiler range (no-op where unsupported)."""

    @abc.abstractmethod
    def range_pop(self) -> None:
        """Close the innermost profiler range (no-op where unsupported)."""

    @abc.abstractmethod
    def lazy_call(self, callback: Callable[[], object]) -> None:
        """Run `callback` once the device runtime is initialised (now, where there is nothing to wait for)."""

    @abc.abstractmethod
    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run on this device."""

    def op_builder_dir(self) -> str:
        """Import path of the package that holds the op builders."""
        return "slipstream.ops.op_builder"

    def get_compile_backend(self) -> str:
        """The `torch.compile` backend name to use ("inductor" unless set)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the `torch.compile` backend; any non-empty name is accepted and checked by torch.compile."""
        if not isinstance(backend, str) or not backend.strip():
            raise ValueError(
                f"compile backend must be a non-empty string such as {DEFAULT_COMPILE_BACKEND!r}, got {backend!r}"
            )
        self._compile_backend = backend.strip()


class DeviceModuleCalls:
    """The calls a GPU backend forwards unchanged to its torch device module (`torch.<_name>`: torch.cuda,
    torch.mps); mixed in before `Accelerator` (or a subclass of it) by cuda.py and mps.py."""

    _name: str

    @property
    def _device_module(self) -> ModuleType:
        module: ModuleType = getattr(torch, self._name)
        return module

    @property
    def Event(self) -> type[EventLike]:
        event: type[EventLike] = self._device_module.Event
        return event

    def empty_cache(self) -> None:
        self._device_module.empty_cache()

    def manual_seed(self, seed: int) -> None:
        self._device_module.manual_seed(seed)
