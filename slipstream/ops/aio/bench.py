"""Read and write throughput of the async_io op on a directory: `slipstream io` (DeepSpeed's ds_io) prints it,
`slipstream nvme tune` (tune.py) sweeps the settings with it.

One file per size in the directory; buffers are page-aligned (`new_cpu_locked_tensor`), so the transfer is
O_DIRECT wherever the file system allows it (`direct_io_supported`; else the figures include the page
cache). A "write" rewrites the size's file, which the first, untimed write created: the steady state of
NVMe offload, where swap files are rewritten every step. A "read" reads it back whole. One transfer is
one async call then `wait()`, as the offload swapper issues them. `verify()` reads every file back and
compares it with what was written.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from slipstream.ops.aio.handle import AioSettings, AsyncIOHandle

SETTING_NAMES = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")


def as_section(settings: AioSettings) -> dict[str, int | bool]:
    """The `aio` section of a DeepSpeed config with these settings."""
    return {name: getattr(settings, name) for name in SETTING_NAMES}


def describe(settings: AioSettings) -> str:
    return ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in as_section(settings).items())


@dataclasses.dataclass(frozen=True, slots=True)
class Throughput:
    """`op` ('write' or 'read') of `size_bytes`, timed `len(seconds)` times."""

    op: str
    size_bytes: int
    seconds: tuple[float, ...]

    @property
    def gb_s(self) -> float:
        """GB/s (1e9 bytes per second) of the median transfer."""
        return self.size_bytes / statistics.median(self.seconds) / 1e9

    def as_dict(self) -> dict[str, Any]:
        rates = [self.size_bytes / s / 1e9 for s in self.seconds]
        return {
            "op": self.op,
            "size_bytes": self.size_bytes,
            "loops": len(self.seconds),
            "gb_s": self.gb_s,
            "min_gb_s": min(rates),
            "max_gb_s": max(rates),
            "median_s": statistics.median(self.seconds),
        }


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (and SLIPSTREAM_AIO_DIRECT does not turn it off)."""
    if os.environ.get("SLIPSTREAM_AIO_DIRECT", "1") == "0" or not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(directory) / f".slipstream-direct-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


def implementation(handle: AsyncIOHandle) -> dict[str, str]:
    """Which async_io ran: {'engine', 'kind' ('native prebuilt', 'native jit' or 'fallback'), 'note'}."""
    from slipstream.ops.op_builder.async_io import AsyncIOBuilder

    status = AsyncIOBuilder().load_status()
    if handle.engine != "python":
        how = status.how if status is not None else "loaded"
        return {
            "engine": handle.engine,
            "kind": f"native {how}",
            "note": f"native async_io op ({how}), engine {handle.engine}",
        }
    reason = status.reason if status is not None and status.how == "fallback" else "not loaded through the builder"
    return {
        "engine": "python",
        "kind": "fallback",
        "note": "the native async_io op is unavailable here, so its pure-Python thread-pool fallback ran "
        f"(min(intra_op_parallelism x queue_depth, 8) threads of pread/pwrite; single_submit and "
        f"overlap_events change nothing in it); why: {reason}",
    }


class IoBench:
    """Transfers of the async_io op between page-aligned buffers and files in `directory` (see the module doc).

    Handles are made per settings and kept; a size's buffers and file are made on first use and shared by
    every settings. `close()` removes the files.
    """

    def __init__(self, directory: str | os.PathLike[str], *, module: ModuleType | None = None) -> None:
        self.directory = Path(directory)
        self.module = module
        self._handles: dict[AioSettings, AsyncIOHandle] = {}
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tag = f"slipstream-io-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def handle(self, settings: AioSettings) -> AsyncIOHandle:
        if settings not in self._handles:
            self._handles[settings] = AsyncIOHandle(settings, module=self.module)
            self.module = self._handles[settings].module
        return self._handles[settings]

    def reported_settings(self, settings: AioSettings) -> dict[str, int | bool]:
        """The five settings as the handle made for `settings` reports them (what the op really uses)."""
        handle = self.handle(settings)
        return {
            "block_size": handle.get_block_size(),
            "queue_depth": handle.get_queue_depth(),
            "intra_op_parallelism": handle.get_intra_op_parallelism(),
            "single_submit": handle.get_single_submit(),
            "overlap_events": handle.get_overlap_events(),
        }

    def path(self, size: int) -> Path:
        return self.directory / f"{self._tag}-{size}.bin"

    def _buffers_for(self, settings: AioSettings, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if size not in self._buffers:
            handle = self.handle(settings)
            example = torch.empty(0, dtype=torch.uint8)
            written, read = handle.new_cpu_locked_tensor(size, example), handle.new_cpu_locked_tensor(size, example)
            pattern = torch.Generator().manual_seed(size)
            written.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=pattern))
            read.zero_()
            handle.async_pwrite(written, self.path(size))
            handle.wait()  # creates the file: later writes are rewrites
            self._buffers[size] = (written, read)
        return self._buffers[size]

    def transfer(self, settings: AioSettings, size: int, op: str) -> float:
        """Seconds of one `op` ('write' or 'read') of `size` bytes with `settings`."""
        written, read = self._buffers_for(settings, size)
        handle = self.handle(settings)
        start = time.perf_counter()
        if op == "write":
            handle.async_pwrite(written, self.path(size))
        elif op == "read":
            handle.async_pread(read, self.path(size))
        else:
            raise ValueError(f"op {op!r}: expected 'write' or 'read'")
        handle.wait()
        return time.perf_counter() - start

    def measure(self, settings: AioSettings, sizes: list[int], ops: list[str], loops: int) -> list[Throughput]:
        """Every op at every size `loops` times, the ops interleaved within a loop (write, read, write, ...)."""
        seconds: dict[tuple[str, int], list[float]] = {(op, size): [] for size in sizes for op in ops}
        for _ in range(loops):
            for size in sizes:
                for op in ops:
                    seconds[(op, size)].append(self.transfer(settings, size, op))
        return [Throughput(op, size, tuple(seconds[(op, size)])) for size in sizes for op in ops]

    def verify(self, settings: AioSettings) -> list[int]:
        """Read every size's file back; the sizes whose bytes differ from what was written (none: [])."""
        bad = []
        for size, (written, read) in self._buffers.items():
            read.zero_()
            self.transfer(settings, size, "read")
            if not torch.equal(written, read):
                bad.append(size)
        return bad

    def close(self) -> None:
        for size in self._buffers:
            self.path(size).unlink(missing_ok=True)
        self._buffers.clear()
        self._handles.clear()
