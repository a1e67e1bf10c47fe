"""zero_optimization.zenflow: the plan DeepSpeed's rules give, and the combinations refused by key and fix."""

from __future__ import annotations

import warnings

import pytest

from slipstream.config import ConfigError, resolve


def _config(zenflow: dict, *, stage: int = 2, device: str | None = "cpu") -> dict:
    zero: dict = {"stage": stage, "zenflow": zenflow}
    if device is not None:
        zero["offload_optimizer"] = {"device": device, "nvme_path": "/tmp"}
    return {"train_batch_size": 4, "zero_optimization": zero}


def test_defaults_select_per_epoch_and_leave_auto_update_to_the_optimizer() -> None:
    plan = resolve(_config({}), world_size=1).zero.zenflow
    assert plan is not None
    assert (plan.topk_ratio, plan.select_every, plan.select_per_epoch) == (0.1, 1, True)
    assert plan.update_interval is None and plan.full_warm_up_rounds == 0
    assert not plan.overlap_step and not plan.offload


def test_step_strategy() -> None:
    section = {"topk_ratio": 0.2, "select_strategy": "step", "select_interval": 8, "update_interval": 4,
               "full_warm_up_rounds": 3, "offload": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key set here is honoured: nothing reported as not implemented
        plan = resolve(_config(section), world_size=1)
    zenflow = plan.zero.zenflow
    assert zenflow is not None and not any("zenflow" in key for key in plan.unimplemented)
    assert (zenflow.topk_ratio, zenflow.select_every, zenflow.select_per_epoch) == (0.2, 8, False)
    assert (zenflow.update_interval, zenflow.full_warm_up_rounds, zenflow.offload) == (4, 3, True)


def test_keys_without_effect_are_reported() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = resolve(_config({"update_interval": 2, "pt_reserved_cores_perc": 0.3, "auto_ratio": 0.5}), world_size=1)
    assert {k for k in plan.unimplemented if "zenflow" in k} == {
        "zero_optimization.zenflow.pt_reserved_cores_perc",
        "zero_optimization.zenflow.auto_ratio",
    }


def test_no_section_no_plan() -> None:
    assert resolve({"train_batch_size": 4}, world_size=1).zero.zenflow is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_config({}, stage=3), "zenflow: ZenFlow runs at ZeRO stages 1 and 2 (zero_optimization.stage is 3)"),
        (_config({}, stage=0, device=None), "set zero_optimization.stage to 1 or 2"),
        (_config({}, device=None), 'offload_optimizer.device "cpu" (it is "none")'),
        (_config({}, device="nvme"), '(it is "nvme"); set it to "cpu"'),
        (_config({"select_strategy": "often"}), "select_strategy: 'often' is not one of"),
        (_config({"select_interval": 3}), 'select_interval: 3 is not used with select_strategy "auto"'),
        (_config({"select_strategy": "step"}), 'select_interval: "auto" needs select_strategy "auto"'),
        (_config({"select_strategy": "step", "select_interval": 2, "update_interval": 4}),
         "select_interval: 2 is below update_interval 4"),
        (_config({"update_interval": 0}), "update_interval: 0 < 1"),
    ],
)
def test_refused_with_key_and_fix(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(config, world_size=1)
    assert message in str(info.value)
