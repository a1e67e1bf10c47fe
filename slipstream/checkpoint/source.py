"""What checkpoint loading needs from its two sides, as Protocols: a source of named tensors (a Slipstream
checkpoint's reader, or a DeepSpeed / universal checkpoint converted in memory) and an optimizer wrapper that
holds the torch optimizer whose param groups and state are saved and restored."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class TensorSource(Protocol):
    """Named tensors of a checkpoint, readable whole or by flat element range, and its JSON scalars."""

    @property
    def scalars(self) -> dict[str, Any]: ...

    @property
    def location(self) -> str: ...

    def keys(self) -> list[str]: ...

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]: ...

    def read(self, key: str) -> torch.Tensor: ...

    def read_flat_range(self, key: str, start: int, end: int, *, out: torch.Tensor | None = None) -> torch.Tensor: ...


class WrapsOptimizer(Protocol):
    """An optimizer wrapper (ZeroOptimizer, the pipeline's stage optimizer) over a torch optimizer."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
