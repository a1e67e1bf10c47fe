"""Where a loaded checkpoint puts Adam's `step`: beside the value it replaces, else on the parameter's device for
fused or capturable optimizers (torch's fused CUDA AdamW refuses a CPU step: found on a GPU, where every
optimizer step after a load failed), else on the CPU. The parameter is on the meta device here, standing for an
accelerator the CPU machine does not have."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slipstream.checkpoint.load import _scalar_tensor


def _setup(**group: object) -> tuple[SimpleNamespace, SimpleNamespace]:
    param = torch.empty(4, device="meta")
    optimizer = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"params": [param], **group}]))
    return optimizer, SimpleNamespace(piece=param, group_index=0)


def test_fused_and_capturable_keep_step_on_the_parameters_device() -> None:
    for flags in ({"fused": True}, {"capturable": True}):
        optimizer, piece = _setup(**flags)
        step = _scalar_tensor(optimizer, piece, "step", 3, None)
        assert step.device.type == "meta" and step.dtype == torch.float32, flags


def test_plain_optimizers_keep_step_on_the_cpu() -> None:
    optimizer, piece = _setup(fused=None, capturable=False)
    step = _scalar_tensor(optimizer, piece, "step", 3, None)
    assert step.device.type == "cpu" and float(step) == 3.0


def test_an_existing_value_keeps_its_place_and_dtype() -> None:
    optimizer, piece = _setup(fused=True)
    existing = torch.tensor(1.0, dtype=torch.float64)
    step = _scalar_tensor(optimizer, piece, "step", 7, existing)
    assert step.device.type == "cpu" and step.dtype == torch.float64 and float(step) == 7.0
