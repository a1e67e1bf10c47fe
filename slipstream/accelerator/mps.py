"""The Apple-silicon backend (Metal Performance Shaders): one GPU sharing memory with the host.

This module owns `MpsAccelerator` and `unavailable_reason()`. MPS has one device, no user-visible
streams (a `HostStream` stands in) and no collective backend of its own: "gloo" is reported, and
tensors must be staged through host memory for collectives. Memory is unified, so total/available
memory are the host's (see cpu.py's [Note: CPU memory numbers]); allocation numbers come from torch.mps.
Importing this module touches no GPU.
"""

from __future__ import annotations

from typing import cast

import torch

from slipstream.accelerator.base import DeviceModuleCalls
from slipstream.accelerator.cpu import HostMemoryAccelerator


def unavailable_reason() -> str | None:
    """None when MPS is usable; else one sentence saying why not (for error messages)."""
    if torch.backends.mps.is_available():
        return None
    if not torch.backends.mps.is_built():
        return f"torch.backends.mps.is_built() is False (torch {torch.__version__} was built without MPS)"
    return "torch.backends.mps.is_available() is False (MPS needs Apple silicon and macOS 12.3 or newer)"


class MpsAccelerator(DeviceModuleCalls, HostMemoryAccelerator):
    """The single Metal GPU of an Apple-silicon Mac."""

    _name = "mps"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._sampled_peak = 0  # torch.mps has no peak counter; see max_memory_allocated

    def is_available(self) -> bool:
        return torch.backends.mps.is_available()

    def set_device(self, device_index: int) -> None:
        if device_index != 0:
            raise ValueError(f"MPS has exactly one device (index 0); set_device got {device_index}")

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def synchronize(self, device_index: int | None = None) -> None:
        torch.mps.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)  # one MPS device: seeding all devices is seeding it

    def initial_seed(self) -> int:
        return int(self.default_generator(0).initial_seed())

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        torch.mps.set_rng_state(state)

    def default_generator(self, device_index: int) -> torch.Generator:
        getter = getattr(torch.mps, "_get_default_mps_generator", None)
        if getter is None:
            raise RuntimeError(
                f"torch {torch.__version__} does not expose the default MPS generator; "
                "use get_rng_state()/set_rng_state() instead"
            )
        return cast(torch.Generator, getter())

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by live MPS tensors (torch.mps.current_allocated_memory)."""
        current = int(torch.mps.current_allocated_memory())
        self._sampled_peak = max(self._sampled_peak, current)
        return current

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Largest `memory_allocated` seen by this object's calls since the reset (MPS has no peak)."""
        return max(self._sampled_peak, self.memory_allocated())

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes the Metal driver holds for this process (torch.mps.driver_allocated_memory)."""
        return int(torch.mps.driver_allocated_memory())

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        current = self.memory_allocated()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": self.max_memory_allocated(),
            "reserved_bytes.all.current": self.memory_reserved(),
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._sampled_peak = 0

    def is_bf16_supported(self) -> bool:
        """bfloat16 on MPS needs macOS 14 or newer."""
        if not self.is_available():
            return False
        is_macos_or_newer = getattr(torch.backends.mps, "is_macos_or_newer", None)
        return bool(is_macos_or_newer(14, 0)) if is_macos_or_newer is not None else False

    def is_fp16_supported(self) -> bool:
        return self.is_available()
