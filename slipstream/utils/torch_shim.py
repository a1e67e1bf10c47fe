"""The one place Slipstream touches private PyTorch APIs (docs/design.md P11), each with a note on why.

- `no_subclass_dispatch()`: run an op on tensor subclasses as plain tensors (the sharded parameter's
  `__torch_function__` uses it so op results stay plain tensors, as nn.Parameter's own disabled impl does).
- `queue_end_of_backward(callback)`: run `callback` when the current autograd backward pass finishes
  (ZeRO-3 reduces the remaining gradients and frees gathered parameters there). Only valid while a
  backward pass is running (inside an autograd hook).
- `storage_use_count(tensor)`: how many references hold the tensor's storage, or None where torch does not
  say (ZeRO-3 asks whether tensors taken inside GatheredParameters still alias a unit's gathered storage
  before releasing it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def no_subclass_dispatch() -> Any:
    return torch._C.DisableTorchFunctionSubclass()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def storage_use_count(tensor: torch.Tensor) -> int | None:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    storage = tensor.untyped_storage()
    return int(use_count(storage._cdata)) - 1  # without `storage`, the reference made here
