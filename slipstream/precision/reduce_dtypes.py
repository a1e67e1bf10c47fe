"""`torch_autocast.lower_precision_safe_modules`: which parameters' gradients are reduced in the autocast dtype.

Under `torch_autocast` the parameters and their gradients stay fp32. As in DeepSpeed, the parameters of the
modules whose class is one of the configured classes (exactly that class, not a subclass; by default Linear
and Conv1d/2d/3d) have their gradients reduced in the autocast dtype (bf16 or fp16), and every other
parameter's gradients in the ZeRO reduce dtype (fp32, or `communication_data_type` when set). Each gradient is
accumulated back in fp32 after its reduction.

`mark_reduce_dtypes` records the dtype on each such parameter (an attribute: the parameter objects outlive
ZeRO's placement, stage 3's sharding included); the ZeRO stages read it with `reduce_dtype_of`. Stages 0-2 lay
such parameters out in buckets of their own (zero/layout.py); stage 3 reduce-scatters a unit's parameters of
each dtype in a collective of their own (zero/stage3/dtype_split.py).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from slipstream.config.plan import PrecisionPlan
from slipstream.config.precision_plans import AutocastPlan
from slipstream.precision.autocast import forward_region
from slipstream.precision.fp8 import apply_fp8_plan

_ATTRIBUTE = "_slipstream_reduce_dtype"
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def safe_module_classes(paths: tuple[str, ...]) -> tuple[type, ...]:
    """The classes named by `paths` ("torch.nn.Linear"), imported; an error names a path that is not one."""
    classes: list[type] = []
    for path in paths:
        module_name, _, class_name = path.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(
                f"torch_autocast.lower_precision_safe_modules: cannot import {path!r} ({error}); name a module "
                'class by its import path, e.g. "torch.nn.Linear"'
            ) from None
        if not isinstance(found, type):
            raise ValueError(
                f"torch_autocast.lower_precision_safe_modules: {path!r} is a {type(found).__name__}, not a class; "
                "name a module class"
            )
        classes.append(found)
    return tuple(classes)


def mark_reduce_dtypes(model: nn.Module, plan: AutocastPlan | None, *, device_type: str) -> nn.Module:
    """Record the forward's autocast dtype on `device_type` as the reduce dtype of the direct parameters of
    `model`'s modules of the plan's safe classes; returns `model`. Nothing without autocast."""
    if plan is None or not plan.safe_modules:
        return model
    dtype = forward_region(plan, device_type=device_type).dtype
    if dtype not in _NAMES:
        raise ValueError(
            f"torch_autocast on {device_type} computes in {dtype}: its gradients cannot be reduced in that dtype; "
            'set torch_autocast.dtype to "bfloat16" or "float16"'
        )
    classes = safe_module_classes(plan.safe_modules)
    for module in model.modules():
        if type(module) in classes:
            for param in module.parameters(recurse=False):
                setattr(param, _ATTRIBUTE, _NAMES[dtype])  # type: ignore[index]
    return model


def reduce_dtype_of(param: torch.Tensor) -> str | None:
    """The dtype name ("bf16", "fp16") `param`'s gradient is reduced in, or None: the ZeRO reduce dtype."""
    return getattr(param, _ATTRIBUTE, None)


def before_placement(model: nn.Module, precision: PrecisionPlan, *, device_type: str) -> nn.Module:
    """What the precision plan does to the model before ZeRO places it: the safe modules' reduce dtypes marked
    (their parameters are the same objects after a float8 conversion), then the `fp8` layers swapped in."""
    return apply_fp8_plan(mark_reduce_dtypes(model, precision.autocast, device_type=device_type), precision.fp8)
