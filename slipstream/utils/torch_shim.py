"""The one place Slipstream touches private PyTorch APIs (docs/design.md P11), each with a note on why.

- `no_subclass_dispatch()`: run an op on tensor subclasses as plain tensors (the sharded parameter's
  `__torch_function__` uses it so op results stay plain tensors, as nn.Parameter's own disabled impl does).
- `queue_end_of_backward(callback)`: run `callback` when the current autograd backward pass finishes
  (ZeRO-3 reduces the remaining gradients and frees gathered parameters there). Only valid while a
  backward pass is running (inside an autograd hook).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def no_subclass_dispatch() -> Any:
    return torch._C.DisableTorchFunctionSubclass()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
