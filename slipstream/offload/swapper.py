"""`Swapper`: host tensors moved to files through the `async_io` op and back (see [Note: NVMe swapping] in
nvme.py). Shared by the optimizer's NVMe offload (nvme.py) and the swapped gradient shards (grad_swap.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from slipstream.config.plan import AioPlan
from slipstream.utils.host_memory import cap_mmap_threshold


class Swapper:
    """Moves registered host tensors to files and back (see [Note: NVMe swapping])."""

    def __init__(self, directory: Path, aio: AioPlan) -> None:
        from slipstream.ops.aio import AsyncIOBuilder

        cap_mmap_threshold()  # swapped buffers go back to the OS when released ([Note: glibc's mmap threshold])
        self.directory = directory
        module = AsyncIOBuilder().load()
        self.handle = module.aio_handle(
            aio.block_size, aio.queue_depth, aio.single_submit, aio.overlap_events, aio.intra_op_parallelism
        )
        self._where: dict[int, tuple[str, int]] = {}
        self._file_bytes: dict[str, int] = {}
        self._reading: set[int] = set()

    def _place(self, tensor: torch.Tensor, name: str) -> tuple[str, int]:
        key = id(tensor)
        if key not in self._where:
            path = str(self.directory / f"{name}.swp")
            offset = self._file_bytes.get(path, 0)
            size = tensor.numel() * tensor.element_size()
            self._file_bytes[path] = offset + (size + 4095) // 4096 * 4096
            self._where[key] = (path, offset)
        return self._where[key]

    @staticmethod
    def resident(tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().nbytes() > 0 or tensor.numel() == 0

    def swap_out(self, tensors: list[tuple[torch.Tensor, str]]) -> None:
        """Write `tensors` (resident ones) to their files, then release their memory."""
        written = []
        for tensor, name in tensors:
            if not self.resident(tensor) or tensor.numel() == 0:
                continue
            path, offset = self._place(tensor, name)
            self.handle.async_pwrite(tensor, path, offset)
            written.append(tensor)
        if written:
            self.handle.wait()
        for tensor in written:
            tensor.untyped_storage().resize_(0)

    def drop(self, tensors: list[tuple[torch.Tensor, str]]) -> None:
        """Release tensors whose file copy is current (unchanged since read); write the never-written ones."""
        fresh = [(t, n) for t, n in tensors if id(t) not in self._where]
        self.swap_out(fresh)
        for tensor, _ in tensors:
            if id(tensor) in self._where and self.resident(tensor):
                tensor.untyped_storage().resize_(0)

    def forget(self, tensor: torch.Tensor) -> None:
        """`tensor`'s values are no longer needed: drop its file slot and its memory (its file is the caller's)."""
        self._where.pop(id(tensor), None)
        self._reading.discard(id(tensor))
        tensor.untyped_storage().resize_(0)

    def start_swap_in(self, tensors: list[torch.Tensor]) -> None:
        """Re-grow and start reading `tensors` that were swapped out (`finish_swap_in` waits)."""
        for tensor in tensors:
            key = id(tensor)
            if self.resident(tensor) or key not in self._where or key in self._reading:
                continue
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            path, offset = self._where[key]
            self.handle.async_pread(tensor, path, offset)
            self._reading.add(key)

    def finish_swap_in(self, tensors: list[torch.Tensor]) -> None:
        self.start_swap_in(tensors)
        if self._reading:
            self.handle.wait()
            self._reading.clear()
