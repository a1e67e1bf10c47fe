"""`AsyncIOHandle`: an `aio_handle` of the loaded async_io module (native or fallback) made from the `aio`
section's settings (one `AioSettings` object, e.g. the plan's `AioPlan`: the defaults live in the config schema
only), with path-like file names, the engine's name, and a `with` block that waits on exit.

Buffers for O_DIRECT: `new_cpu_locked_tensor` gives page-aligned memory; with file offsets that are
multiples of `alignment` (4096), a transfer goes straight between the buffer and the device. Other
buffers work too (the native op copies through aligned bounce buffers, the fallback uses plain I/O).
"""

from __future__ import annotations

import os
from types import ModuleType, TracebackType
from typing import Any, Protocol

import torch

from slipstream.ops.op_builder.async_io import AsyncIOBuilder

PathLike = str | os.PathLike[str]

SETTING_NAMES = ("block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism")
"""The `aio` section's keys: the handle's settings, in the order the native handle takes them."""


class AioSettings(Protocol):
    """The `aio` config section's five settings: the resolved plan's `AioPlan` (config/plan.py) is one; this
    layer only reads them, so it needs no import of the config layer (ops is a leaf)."""

    @property
    def block_size(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def intra_op_parallelism(self) -> int: ...
    @property
    def single_submit(self) -> bool: ...
    @property
    def overlap_events(self) -> bool: ...


class AsyncIOHandle:
    """Asynchronous tensor reads and writes to files, with the `aio` config section's five settings."""

    def __init__(self, settings: AioSettings, *, module: ModuleType | None = None) -> None:
        self.module = module if module is not None else AsyncIOBuilder().load()
        self._handle: Any = self.module.aio_handle(*(getattr(settings, name) for name in SETTING_NAMES))

    @property
    def engine(self) -> str:
        """'libaio', 'io_uring' or 'sync' (native), 'python' (fallback)."""
        return str(self._handle.engine())

    @property
    def alignment(self) -> int:
        return int(self._handle.get_alignment())

    def async_pread(self, tensor: torch.Tensor, path: PathLike, file_offset: int = 0) -> int:
        return int(self._handle.async_pread(tensor, os.fspath(path), file_offset))

    def async_pwrite(self, tensor: torch.Tensor, path: PathLike, file_offset: int = 0) -> int:
        return int(self._handle.async_pwrite(tensor, os.fspath(path), file_offset))

    def sync_pread(self, tensor: torch.Tensor, path: PathLike, file_offset: int = 0) -> int:
        return int(self._handle.sync_pread(tensor, os.fspath(path), file_offset))

    def sync_pwrite(self, tensor: torch.Tensor, path: PathLike, file_offset: int = 0) -> int:
        return int(self._handle.sync_pwrite(tensor, os.fspath(path), file_offset))

    def wait(self) -> int:
        """Block until all submitted requests finished; returns how many, raises AsyncIOError on a failure."""
        return int(self._handle.wait())

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        tensor: torch.Tensor = self._handle.new_cpu_locked_tensor(num_elem, example_tensor)
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return bool(self._handle.free_cpu_locked_tensor(tensor))

    def get_block_size(self) -> int:
        return int(self._handle.get_block_size())

    def get_queue_depth(self) -> int:
        return int(self._handle.get_queue_depth())

    def get_single_submit(self) -> bool:
        return bool(self._handle.get_single_submit())

    def get_overlap_events(self) -> bool:
        return bool(self._handle.get_overlap_events())

    def get_intra_op_parallelism(self) -> int:
        return int(self._handle.get_intra_op_parallelism())

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.wait()
            return
        try:
            self.wait()  # let in-flight I/O into the caller's buffers stop before the error propagates
        except OSError:
            pass
