"""The forward's autocast region, chosen once by type from the plan (`NoAutocast` or `AutocastRegion`).

With `torch_autocast` (or `amp`, mapped onto it) the parameters, their gradients and the masters stay fp32;
the engine's forward runs under `torch.autocast(device_type=<the accelerator's>, dtype=...)`, so the ops
autocast lists (matmuls, convolutions, linear layers) compute in the low dtype and the rest in fp32.
An autocast region the caller opened around `engine(...)` is replaced by the configured one, as DeepSpeed
does; without autocast in the config the engine leaves the caller's region alone.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from slipstream.config.precision_plans import AutocastPlan

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class NoAutocast:
    """No autocast from the config: the forward runs as the caller runs it."""

    dtype: torch.dtype | None = None

    def region(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()


class AutocastRegion(NoAutocast):
    """The forward under torch.autocast with `dtype` on `device_type` (the accelerator's device name)."""

    def __init__(self, dtype: torch.dtype, *, device_type: str) -> None:
        self.dtype = dtype
        self.device_type = device_type

    def region(self) -> AbstractContextManager[object]:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, enabled=True)


def forward_region(plan: AutocastPlan | None, *, device_type: str) -> NoAutocast:
    """The region the engine's forward runs in for `plan` (None: no autocast)."""
    if plan is None:
        return NoAutocast()
    dtype = _DTYPES[plan.dtype] if plan.dtype is not None else torch.get_autocast_dtype(device_type)
    return AutocastRegion(dtype, device_type=device_type)
