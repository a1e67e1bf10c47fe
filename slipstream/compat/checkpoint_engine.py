"""`deepspeed.runtime.checkpoint_engine`: the pluggable writer interface and its torch implementation.

Slipstream's engine writes its own format (safetensors plus a manifest, atomically: docs/design.md D12) and
takes no checkpoint engine; these classes exist for client code that uses them directly to write files.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class CheckpointEngine:
    """DeepSpeed's interface: `create(tag)`, `makedirs`, `save(state_dict, path)`, `load(path)`, `commit(tag)`."""

    def __init__(self, config_params: Any = None) -> None:
        self.name: str | None = None
        self.config_params = config_params

    def create(self, info: Any) -> None:
        return None

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        raise NotImplementedError(f"{type(self).__name__}.save: subclass CheckpointEngine and implement it")

    def load(self, path: str, map_location: Any = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.load: subclass CheckpointEngine and implement it")

    def commit(self, tag: Any) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def cleanup(self) -> None:
        return None


class TorchCheckpointEngine(CheckpointEngine):
    """`torch.save` / `torch.load` (weights only unless told otherwise)."""

    def save(self, state_dict: Any, path: str) -> None:
        torch.save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location)
