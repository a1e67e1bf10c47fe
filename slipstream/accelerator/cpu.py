"""The CPU backend: host memory as the "device", gloo for communication.

This module owns `CpuAccelerator`, `HostMemoryAccelerator` (what it shares with mps.py's backend), the null stream/event types every synchronous backend can use
(`HostStream`, `HostEvent`), and the host-memory readers (`host_rss_bytes`, `host_total_memory`, ...)
that `mps.py` reuses because Apple silicon memory is unified.

[Note: CPU memory numbers]
There is no allocator to ask, so the memory API reports the process and the machine:
- `memory_allocated` / `memory_reserved`: the process's resident set size (RSS), from
  /proc/self/statm, else psutil if importable, else the peak RSS from getrusage (an overestimate).
- `max_memory_allocated`: the kernel's RSS high-water mark (VmHWM in /proc/self/status, else
  getrusage ru_maxrss). `reset_max_memory_allocated` writes "5" to /proc/self/clear_refs, which resets
  VmHWM to the current RSS (Linux >= 4.0). Where that is refused, the peak is tracked instead: the
  largest RSS seen by calls to this object since the reset, so short spikes between calls are missed.
- `total_memory` / `available_memory`: MemTotal / MemAvailable from /proc/meminfo (else psutil, else
  sysconf), clamped by the cgroup memory limit when one is set, because in a container /proc/meminfo
  describes the host, not what this process may use.
RSS counts everything the process holds (Python, torch's allocator caches, the model), not only tensors.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable

import torch

from slipstream.accelerator.base import Accelerator, EventLike, StreamLike

_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_CGROUP_USAGE_FILES = ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")


class HostStream:
    """A stream on a synchronous device: work is already done when it is queued, so every wait is a no-op."""

    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.device = device
        self.priority = priority

    def synchronize(self) -> None:
        """Nothing is ever pending."""

    def query(self) -> bool:
        """Always True: all work has completed."""
        return True

    def wait_stream(self, stream: StreamLike) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: HostEvent) -> None:
        """Nothing to wait for."""

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        """Record (and return) `event`, or a new one, at the current host time."""
        event = event if event is not None else HostEvent()
        event.record(self)
        return event


class HostEvent:
    """An event on a synchronous device: `record` notes the host clock, so `elapsed_time` is wall time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: StreamLike | None = None) -> None:
        """Note the current host time."""
        self._recorded_at = time.perf_counter()

    def wait(self, stream: StreamLike | None = None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing is ever pending."""

    def query(self) -> bool:
        """Always True: all work has completed."""
        return True

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds between this event's and `end_event`'s `record()` calls."""
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events recorded; call start.record() and end.record() first")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


# ---------------------------------------------------------------------- host memory readers
def _read_int_file(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _proc_kib_field(path: str, field: str) -> int | None:
    """Value of a "Field:   123 kB" line in a /proc file, in bytes."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _ru_maxrss_bytes() -> int:
    if sys.platform == "win32":  # no /proc and no getrusage: memory figures there need psutil
        return 0
    import resource  # POSIX only: imported on use, so the package imports on Windows

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def host_rss_bytes() -> int:
    """Resident set size of this process in bytes (see [Note: CPU memory numbers])."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    try:
        import psutil  # optional; not a dependency

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return _ru_maxrss_bytes()


def host_peak_rss_bytes() -> int:
    """The kernel's RSS high-water mark for this process, in bytes."""
    hwm = _proc_kib_field("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else _ru_maxrss_bytes()


def _cgroup_limit_and_usage() -> tuple[int, int] | None:
    for limit_file, usage_file in zip(_CGROUP_LIMIT_FILES, _CGROUP_USAGE_FILES):
        limit = _read_int_file(limit_file)
        if limit is not None:
            usage = _read_int_file(usage_file)
            return limit, usage if usage is not None else 0
    return None


def _psutil_virtual_memory() -> tuple[int, int] | None:
    try:
        import psutil  # optional; not a dependency
    except ImportError:
        return None
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def _machine_memory(*, meminfo_field: str, psutil_index: int, sysconf_pages: str) -> int:
    """One /proc/meminfo field in bytes, else psutil's virtual_memory()[psutil_index], else sysconf pages."""
    value = _proc_kib_field("/proc/meminfo", meminfo_field)
    if value is not None:
        return value
    vm = _psutil_virtual_memory()
    return vm[psutil_index] if vm is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf(sysconf_pages)


def host_total_memory() -> int:
    """Bytes of host memory this process may use (see [Note: CPU memory numbers])."""
    total = _machine_memory(meminfo_field="MemTotal", psutil_index=0, sysconf_pages="SC_PHYS_PAGES")
    cgroup = _cgroup_limit_and_usage()
    return min(total, cgroup[0]) if cgroup is not None else total


def host_available_memory() -> int:
    """Bytes of host memory that could still be allocated (see [Note: CPU memory numbers])."""
    available = _machine_memory(meminfo_field="MemAvailable", psutil_index=1, sysconf_pages="SC_AVPHYS_PAGES")
    cgroup = _cgroup_limit_and_usage()
    if cgroup is not None:
        available = min(available, max(cgroup[0] - cgroup[1], 0))
    return available


class HostPeakTracker:
    """Peak RSS since the last reset: the kernel's high-water mark when it can be reset, else sampled."""

    def __init__(self) -> None:
        self._sampled_peak: int | None = None  # None: the kernel's VmHWM is authoritative

    def peak(self) -> int:
        if self._sampled_peak is None:
            return host_peak_rss_bytes()
        self._sampled_peak = max(self._sampled_peak, host_rss_bytes())
        return self._sampled_peak

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self._sampled_peak = None
        except OSError:
            self._sampled_peak = host_rss_bytes()


class HostMemoryAccelerator(Accelerator):
    """What every backend whose tensors live in host memory shares (the CPU, and MPS's unified memory): no
    user-visible streams (a `HostStream` stands in), the host's memory totals, no pinning, no device-visibility
    or launcher variables, no range profiler, no deferred runtime initialisation, no Triton."""

    @property
    def Stream(self) -> type[HostStream]:
        return HostStream

    def has_streams(self) -> bool:
        return False

    def stream(self, stream: StreamLike | None) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext(stream)

    def current_stream(self, device_index: int | None = None) -> HostStream:
        return HostStream()

    def default_stream(self, device_index: int | None = None) -> HostStream:
        return HostStream()

    def total_memory(self, device_index: int | None = None) -> int:
        """Host memory this process may use (see [Note: CPU memory numbers])."""
        return host_total_memory()

    def available_memory(self, device_index: int | None = None) -> int:
        """Host memory that could still be allocated (see [Note: CPU memory numbers])."""
        return host_available_memory()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """`tensor` unchanged: pinning only helps copies from host to a separate device memory."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """False: this backend never pins (and asking torch could initialise a GPU runtime)."""
        return False

    def visible_devices_envs(self) -> list[str]:
        return []

    def export_envs(self) -> list[str]:
        return []

    def range_push(self, msg: str) -> None:
        """No-op: no range profiler is wired in."""

    def range_pop(self) -> None:
        """No-op: no range profiler is wired in."""

    def lazy_call(self, callback: Callable[[], object]) -> None:
        callback()

    def is_triton_supported(self) -> bool:
        return False


class CpuAccelerator(HostMemoryAccelerator):
    """The host as the only device. Always available; synchronous, so host timers are exact."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._peak = HostPeakTracker()

    def is_available(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        """Always "cpu": every local rank shares the one host device, whatever its index."""
        return "cpu"

    def set_device(self, device_index: int) -> None:
        """No-op: there is only one host device."""

    def current_device(self) -> int:
        """Always 0 (DeepSpeed returns LOCAL_RANK here; we keep the index a device index)."""
        return 0

    def device_count(self) -> int:
        """Env `LOCAL_SIZE` (ranks per node, set by the launcher) if set, else 1.

        DeepSpeed counts NUMA nodes with cores here, because its CPU launcher binds one oneCCL rank per
        NUMA node. We use gloo and do not bind ranks to NUMA nodes, so a hardware count would only
        change how many ranks a bare `slipstream` launch starts; 1 is the safe default, and
        `--num_gpus`/`LOCAL_SIZE` says how many ranks to run.
        """
        raw = os.environ.get("LOCAL_SIZE")
        if raw is None or not raw.strip():
            return 1
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"env LOCAL_SIZE={raw!r} must be a positive integer (ranks per node); unset it or fix it")
        return count

    def synchronize(self, device_index: int | None = None) -> None:
        """No-op: CPU work is done when the call returns."""

    def is_synchronized_device(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    @property
    def Event(self) -> type[EventLike]:
        return HostEvent  # type: ignore[return-value]

    def empty_cache(self) -> None:
        """No-op: there is no device cache to release."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Process RSS in bytes; see [Note: CPU memory numbers]."""
        return host_rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak process RSS in bytes since start or the last reset; see [Note: CPU memory numbers]."""
        return self._peak.peak()

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Process RSS in bytes (no allocator cache to add)."""
        return host_rss_bytes()

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        """RSS and peak RSS under torch.cuda.memory_stats' key names."""
        current = host_rss_bytes()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": max(self._peak.peak(), current),
            "reserved_bytes.all.current": current,
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._peak.reset()

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """True: torch's CPU kernels cover float16 for training (slowly without AVX512-FP16/AMX)."""
        return True
