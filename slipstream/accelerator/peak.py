"""Dense peak FLOP/s of known devices, for the step line's MFU (model FLOPs utilisation).

Vendor datasheet figures for dense (not sparse) math. A device not listed, or the CPU (whose peak depends on
cores, vector width and clocks no portable API reports), has no known peak: the step line then shows the
achieved FLOP/s only. Matched on the name `torch.cuda.get_device_name()` reports.
"""

from __future__ import annotations

import torch

__all__ = ["peak_flops"]

# name fragment -> (bf16/fp16 dense, tf32 dense) FLOP/s; the first fragment found in the name wins.
_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 494e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),
    ("H800", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("A800", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("A10G", 70e12, 35e12),
    ("V100", 125e12, 15.7e12),
    ("MI300X", 1307e12, 654e12),
    ("MI250X", 383e12, 95.7e12),
)


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of `device_name` for `dtype` math (fp32 counts as TF32), or None when unknown."""
    for fragment, half, tf32 in _PEAKS:
        if fragment in device_name:
            return half if dtype in (torch.bfloat16, torch.float16) else tf32
    return None
