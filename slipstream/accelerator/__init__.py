"""Device abstraction: `get_accelerator()` returns the backend (cpu, cuda/ROCm, mps) this process uses.

This package owns the device API the rest of Slipstream calls instead of `torch.cuda` directly. Importing
it touches no device; selection happens on the first `get_accelerator()` call (see `registry`).
"""

from __future__ import annotations

from slipstream.accelerator.base import Accelerator
from slipstream.accelerator.registry import (
    SUPPORTED_ACCELERATORS,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    "SUPPORTED_ACCELERATORS",
    "Accelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
