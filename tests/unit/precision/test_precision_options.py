"""The precision options from config to plan and component: torch_autocast / amp as an autocast region, the
rules DeepSpeed enforces on low-precision masters (each refusal names its keys), which keys are honoured and
which stay reported, and the optimizer's moment dtype."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import ConfigError, resolve
from slipstream.ops.adam import DeepSpeedCPUAdam
from slipstream.precision import AutocastRegion, NoAutocast, apply_state_dtype, forward_region

BASE = {"train_batch_size": 4}
Z2_CPU = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def plan(**extra: object):  # type: ignore[no-untyped-def]
    return resolve({**BASE, **extra}, world_size=2)


def test_torch_autocast_and_amp_become_an_autocast_plan() -> None:
    auto = plan(torch_autocast={"enabled": True, "dtype": "torch.bfloat16"}).precision
    assert (auto.autocast.dtype, auto.param_dtype, auto.loss_scale) == ("bf16", "fp32", None)
    assert plan(torch_autocast={"enabled": True}).precision.autocast.dtype is None  # the device's default
    amp = plan(amp={"enabled": True, "opt_level": "O1"})
    assert amp.precision.autocast.dtype == "fp16" and amp.precision.loss_scale is not None
    assert amp.precision.check_grad_overflow
    assert "amp.opt_level" in amp.unimplemented and "amp" not in amp.unimplemented
    modules = plan(torch_autocast={"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]})
    assert modules.unimplemented == () and modules.precision.autocast.safe_modules == ("torch.nn.Linear",)
    assert plan().precision.autocast is None
    assert plan(bf16={"enabled": True}, data_types={"param_dtype": "bfloat16"}).precision.param_dtype == "bf16"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"torch_autocast": {"enabled": True}, "bf16": {"enabled": True}}, "torch_autocast.enabled, bf16.enabled"),
        ({"torch_autocast": {"enabled": True}, "fp16": {"enabled": True}}, "torch_autocast.enabled, fp16.enabled"),
        ({"torch_autocast": {"enabled": True}, "amp": {"enabled": True}}, "torch_autocast.enabled, amp.enabled"),
        ({"torch_autocast": {"enabled": True, "dtype": "fp32"}}, "torch_autocast.dtype='fp32'"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
         "offload_optimizer.device is 'none'"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
         "needs ZeRO stage 1, 2 or 3"),
        ({"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
          "zero_optimization": {"stage": 2}}, "needs bf16.enabled true"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
         "fp16 masters need CPU optimizer offload"),
        ({"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}}, "data_types.param_dtype='fp16'"),
    ],
)
def test_contradictions_are_refused_by_name(extra: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("(", r"\(")):
        plan(**extra)


def test_low_precision_masters_set_master_grad_and_state_dtypes() -> None:
    states = plan(bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                  zero_optimization={"stage": 3})
    p = states.precision
    assert (p.master_dtype, p.grad_accum_dtype, p.optimizer_state_dtype) == ("bf16", "bf16", "bf16")
    assert not states.unimplemented
    masters = plan(bf16={"enabled": True, "bf16_master_weights_and_grads": True}, zero_optimization=Z2_CPU).precision
    assert (masters.master_dtype, masters.optimizer_state_dtype) == ("bf16", "fp32")
    fp16 = plan(fp16={"enabled": True, "fp16_master_weights_and_grads": True}, zero_optimization=Z2_CPU).precision
    assert (fp16.master_dtype, fp16.grad_accum_dtype, fp16.optimizer_state_dtype) == ("fp16", "fp16", "fp32")


def test_the_autocast_region_runs_linear_layers_in_its_dtype() -> None:
    layer, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    region = forward_region(plan(torch_autocast={"enabled": True, "dtype": "bf16"}).precision.autocast,
                            device_type="cpu")
    assert isinstance(region, AutocastRegion)
    with region.region():
        assert layer(x).dtype == torch.bfloat16
    default = forward_region(plan(torch_autocast={"enabled": True}).precision.autocast, device_type="cpu")
    assert default.dtype == torch.get_autocast_dtype("cpu")
    none = forward_region(None, device_type="cpu")
    assert type(none) is NoAutocast
    with none.region():
        assert layer(x).dtype == torch.float32


def test_the_optimizer_keeps_moments_in_the_plans_dtype() -> None:
    bf16_states = plan(bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                       zero_optimization=Z2_CPU).precision
    fp32_states = plan(bf16={"enabled": True, "bf16_master_weights_and_grads": True},
                       zero_optimization=Z2_CPU).precision
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    cpu_adam = DeepSpeedCPUAdam(params)
    with pytest.warns(UserWarning, match="fp32_optimizer_states is set to False"):
        apply_state_dtype(cpu_adam, bf16_states)
    assert cpu_adam.fp32_optimizer_states is False
    kept = DeepSpeedCPUAdam(params)
    apply_state_dtype(kept, fp32_states)
    assert kept.fp32_optimizer_states is True
    with pytest.raises(ValueError, match="bf16.bf16_master_weights_and_grads: the optimizer must keep fp32"):
        apply_state_dtype(torch.optim.AdamW(params), fp32_states)


def test_gradient_predivision_is_planned_at_every_stage() -> None:
    assert plan(prescale_gradients=True).precision.grad_predivide is None  # the reduction group's size
    assert plan(gradient_predivide_factor=4.0).precision.grad_predivide == 4.0
    assert plan().precision.grad_predivide == 1.0
    assert not plan(prescale_gradients=True, zero_optimization={"stage": 2}).unimplemented
    stage3 = plan(prescale_gradients=True, gradient_predivide_factor=2.0, zero_optimization={"stage": 3})
    assert not stage3.unimplemented
