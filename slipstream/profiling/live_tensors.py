"""`LiveTensorBytes`: the peak bytes of tensor storages alive at once inside a block of code.

RSS cannot tell what a computation keeps (the allocator holds freed blocks; other threads allocate); this counts
the storages that torch ops create while the context is active, from their creation until their last reference
goes, and keeps the highest total. Plain tensors only: a DTensor's bytes are its local tensor's, counted where
that is made; meta tensors hold none. Used by the sequence-parallel benchmark and the tiled-compute tests.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorBytes"]


class _Mode(TorchDispatchMode):
    def __init__(self, counter: LiveTensorBytes) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter = counter

    def __torch_dispatch__(
        self,
        func: Callable[..., object],
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type != "meta":
                self.counter.add(tensor)
        return out


class LiveTensorBytes:
    """`with LiveTensorBytes() as live: ...` then `live.peak` (bytes); `live.now` is what is still alive."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._mode = _Mode(self)

    def add(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage (once, however many views of it appear) until it is freed."""
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.now += size
        self.peak = max(self.peak, self.now)

        def release() -> None:
            self._seen.discard(key)
            self.now -= size

        weakref.finalize(storage, release)

    def __enter__(self) -> LiveTensorBytes:
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._mode.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
