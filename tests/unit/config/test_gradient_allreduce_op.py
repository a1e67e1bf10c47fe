"""gradient_allreduce_op is read as DeepSpeed reads it (its tests in runtime/test_ds_config_dict.py): case-insensitive,
DeepSpeed's wording for an invalid value, and 'sum' rejected where DeepSpeed rejects it."""

from __future__ import annotations

import warnings

import pytest

from slipstream.config import ConfigError, resolve


def _resolved(**extra: object) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'sum' is reported as not implemented (D5)
        return resolve({"train_batch_size": 2, **extra}, world_size=1).resolved


def test_values_are_case_insensitive_and_default_to_mean() -> None:
    assert _resolved()["gradient_allreduce_op"] == "mean"
    assert _resolved(gradient_allreduce_op="SUM")["gradient_allreduce_op"] == "sum"


def test_an_invalid_value_is_named_in_deepspeeds_words() -> None:
    with pytest.raises(ConfigError, match="Invalid gradient_allreduce_op 'max'"):
        _resolved(gradient_allreduce_op="max")


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}}, "ZenFlow"),
        ({"zero_optimization": {"stage": 1}, "compile": {"deepcompile": True}}, "DeepCompile"),
    ],
)
def test_sum_is_rejected_where_deepspeed_rejects_it(extra: dict, where: str) -> None:
    with pytest.raises(ConfigError, match=f"'sum' is not supported with {where}"):
        _resolved(gradient_allreduce_op="sum", **extra)
    assert _resolved(gradient_allreduce_op="mean", **extra)["gradient_allreduce_op"] == "mean"


def test_deepspeed_config_exposes_the_value() -> None:
    from slipstream.compat.ds_config import DeepSpeedConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "Sum"}).gradient_allreduce_op == "sum"
