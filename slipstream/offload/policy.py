"""Offload policies, chosen by type (STYLE.md 1c): where the fp32 master pieces, their gradients and the
optimizer state live, and how host buffers are allocated.

- `NoOffload`: everything stays on the parameters' device; master pieces may alias the parameters.
- `CPUOffload` (ZeRO-Offload, `offload_optimizer.device: cpu`): master pieces, their gradients, the
  optimizer state and a low-precision staging buffer live in host memory, pinned when `pin_memory` is on
  and the pinned total stays under half of the host's available memory (else pageable, with a warning).
  Gradients go device -> host before the step; the CPU Adam op updates the master pieces and writes the
  new values in the parameter dtype into the staging buffer in the same pass; that buffer goes host ->
  device. All copies go through the accelerator layer, so on GPUs they are real transfers; on the CPU
  accelerator host and device are the same memory and the policy is exercised for correctness.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from slipstream.utils.logging import warn_once

_PIN_FRACTION = 0.5


def host_available_bytes() -> int:
    """Host memory available to new allocations (MemAvailable), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class OffloadPolicy:
    """No offload: master weights and optimizer state live with the parameters."""

    on_host: bool = False

    def master_device(self, param_device: torch.device) -> torch.device:
        return param_device

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)


NoOffload = OffloadPolicy


@dataclasses.dataclass
class CPUOffload(OffloadPolicy):
    """Master weights, gradients for the step and optimizer state in host memory (see module doc)."""

    pin_memory: bool = True
    pinned_bytes: int = 0
    on_host: bool = dataclasses.field(default=True, init=False)

    def master_device(self, param_device: torch.device) -> torch.device:
        return torch.device("cpu")

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = torch.zeros(numel, dtype=dtype, device="cpu")
        if not self.pin_memory:
            return tensor
        size = numel * tensor.element_size()
        available = host_available_bytes()
        if available and self.pinned_bytes + size > _PIN_FRACTION * available:
            warn_once("offload-pin", f"slipstream: pinning {(self.pinned_bytes + size) / 2**30:.2f} GiB would exceed "
                      f"half of the host's available {available / 2**30:.2f} GiB; using pageable memory for the "
                      "rest (set offload_optimizer.pin_memory false to silence this)")
            return tensor
        from slipstream.accelerator import get_accelerator

        self.pinned_bytes += size
        return get_accelerator().pin_memory(tensor)
