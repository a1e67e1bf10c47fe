"""`torch_autocast.lower_precision_safe_modules` from config to the parameters' reduce dtypes: DeepSpeed's default
classes, class paths imported (a bad one refused by name), exact classes only, and nothing without autocast.
tests/dist/precision/test_safe_modules.py checks the reductions themselves at ZeRO 0-3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.config import ConfigError, resolve
from slipstream.config.precision_plans import DEFAULT_SAFE_MODULES
from slipstream.precision.reduce_dtypes import mark_reduce_dtypes, reduce_dtype_of, safe_module_classes


def plan(**extra: object):  # type: ignore[no-untyped-def]
    return resolve({"train_batch_size": 4, **extra}, world_size=2)


def autocast(**section: object):  # type: ignore[no-untyped-def]
    return plan(torch_autocast={"enabled": True, **section}).precision.autocast


class MyLinear(nn.Linear):
    pass


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), MyLinear(4, 4), nn.Conv1d(2, 2, 3), nn.Embedding(5, 4))


def marked(net: nn.Module) -> list[str | None]:
    return [reduce_dtype_of(p) for p in net.parameters()]


def test_default_is_linear_and_conv_and_the_key_is_honoured() -> None:
    default = autocast(dtype="bfloat16")
    assert default.safe_modules == DEFAULT_SAFE_MODULES
    assert set(safe_module_classes(default.safe_modules)) == {nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d}
    net = mark_reduce_dtypes(model(), default, device_type="cpu")
    # Linear (2), LayerNorm (2), MyLinear (a subclass: not marked, 2), Conv1d (2), Embedding (1)
    assert marked(net) == ["bf16", "bf16", None, None, None, None, "bf16", "bf16", None]
    configured = plan(torch_autocast={"enabled": True, "lower_precision_safe_modules": []})
    assert configured.unimplemented == () and configured.precision.autocast.safe_modules == ()


def test_named_classes_in_the_autocast_dtype() -> None:
    path = f"{__name__}.MyLinear"
    net = mark_reduce_dtypes(model(), autocast(dtype="float16", lower_precision_safe_modules=[path]), device_type="cpu")
    assert marked(net) == [None, None, None, None, "fp16", "fp16", None, None, None]
    assert marked(mark_reduce_dtypes(model(), None, device_type="cpu")) == [None] * 9  # no autocast: nothing
    amp = plan(amp={"enabled": True}).precision.autocast
    assert amp.safe_modules == ()  # Apex's amp has no such list: every gradient in the reduce dtype


def test_bad_class_paths_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="'Linear' is not a class path"):
        autocast(lower_precision_safe_modules=["Linear"])
    with pytest.raises(ValueError, match="cannot import 'torch.nn.NoSuchLayer'"):
        safe_module_classes(("torch.nn.NoSuchLayer",))
    with pytest.raises(ValueError, match="'torch.nn.functional.linear' is a builtin_function_or_method, not a class"):
        safe_module_classes(("torch.nn.functional.linear",))
    assert torch.nn.Linear in safe_module_classes(("torch.nn.Linear",))
