"""Which accelerator this process uses: the `DS_ACCELERATOR` override, auto-detection, and the cache.

This module owns `get_accelerator()`, `set_accelerator()`, `is_current_accelerator_supported()` and
`SUPPORTED_ACCELERATORS`. Nothing is detected at import: the first `get_accelerator()` call decides,
and the answer is cached for the rest of the process.

Selection, as in DeepSpeed's `real_accelerator.py`:
1. env `DS_ACCELERATOR` (case-insensitive; empty counts as unset) names the backend. An unknown name is
   a ValueError listing the valid ones; a known backend this machine cannot run is a RuntimeError
   saying why. Nothing falls back silently when the user asked for something specific.
2. Otherwise the first available backend in `SUPPORTED_ACCELERATORS` order: cuda (also ROCm) when
   `torch.cuda.is_available()` and `device_count() > 0`, then mps, then cpu.

Tests reset the cache with `set_accelerator(None)` (or `_reset_for_tests()`), then set or unset
`DS_ACCELERATOR` and call `get_accelerator()` again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from slipstream.accelerator import cuda, mps
from slipstream.accelerator.base import Accelerator
from slipstream.accelerator.cpu import CpuAccelerator

logger = logging.getLogger(__name__)

ENV_VAR = "DS_ACCELERATOR"


@dataclass(frozen=True)
class _Backend:
    cls: type[Accelerator]
    unavailable_reason: Callable[[], str | None]
    """None when usable on this machine, else why not."""


def _always_available() -> str | None:
    return None


_BACKENDS: tuple[_Backend, ...] = (  # auto-detection order
    _Backend(cuda.CudaAccelerator, cuda.unavailable_reason),
    _Backend(mps.MpsAccelerator, mps.unavailable_reason),
    _Backend(CpuAccelerator, _always_available),
)
_BY_NAME: dict[str, _Backend] = {b.cls._name: b for b in _BACKENDS}

SUPPORTED_ACCELERATORS: tuple[str, ...] = tuple(_BY_NAME)
"""Names `DS_ACCELERATOR` accepts, in auto-detection order."""

_lock = threading.Lock()
_current: Accelerator | None = None


def _from_env(requested: str) -> Accelerator:
    name = requested.strip().lower()
    backend = _BY_NAME.get(name)
    if backend is None:
        raise ValueError(
            f"{ENV_VAR}={requested!r} is not a supported accelerator; valid values are "
            f"{', '.join(SUPPORTED_ACCELERATORS)} (or unset it to auto-detect)"
        )
    reason = backend.unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"{ENV_VAR}={name} but {reason}. Unset {ENV_VAR} to auto-detect, or set it to a backend this machine has."
        )
    logger.info("Setting accelerator to %s (from env %s)", name, ENV_VAR)
    return backend.cls()


def _detect() -> Accelerator:
    for backend in _BACKENDS:
        if backend.unavailable_reason() is None:
            logger.info("Setting accelerator to %s (auto-detected)", backend.cls._name)
            return backend.cls()
    raise AssertionError("the last backend (cpu) is always available")


def get_accelerator() -> Accelerator:
    """The accelerator for this process, chosen on the first call (see the module docstring) and cached."""
    global _current
    with _lock:
        if _current is None:
            requested = os.environ.get(ENV_VAR, "")
            _current = _from_env(requested) if requested.strip() else _detect()
        return _current


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Use `accelerator` from now on; None clears the cache so the next `get_accelerator()` re-selects."""
    global _current
    if accelerator is not None and not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"set_accelerator expects a slipstream.accelerator.Accelerator instance or None, "
            f"got {type(accelerator).__name__}"
        )
    with _lock:
        _current = accelerator


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator is one of Slipstream's own backends (False for custom ones)."""
    return get_accelerator().name in SUPPORTED_ACCELERATORS


def _reset_for_tests() -> None:
    """Forget the cached accelerator (same as `set_accelerator(None)`); for test isolation."""
    set_accelerator(None)
