"""config/zero_plans.py `stage3_plan`: each stage-3 key of the config reaches the Stage3Plan field named for it,
and no other field."""

from __future__ import annotations

import pytest

from slipstream.config.plan import NoOffloadTarget
from slipstream.config.schema.zero import ZeroConfig
from slipstream.config.zero_plans import stage3_plan

NUMBERS = {  # config key -> Stage3Plan field; each key gets its own value, so a swapped pair shows
    "stage3_prefetch_bucket_size": "prefetch_numel",
    "stage3_param_persistence_threshold": "persistence_threshold",
    "stage3_max_live_parameters": "max_live_numel",
    "stage3_max_reuse_distance": "reuse_distance",
    "sub_group_size": "sub_group_numel",
}
FLAGS = {
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_on_save",
    "zero_quantized_weights": "quantized_weights",
    "zero_quantized_nontrainable_weights": "quantized_frozen_weights",
    "zero_quantized_gradients": "quantized_gradients",
}


def _plan(**keys: object) -> object:
    return stage3_plan(ZeroConfig.model_validate({"stage": 3, **keys}), NoOffloadTarget())


def test_each_number_reaches_its_field() -> None:
    values = {key: 1000 + 7 * i for i, key in enumerate(NUMBERS)}
    plan = _plan(**values)
    assert {field: getattr(plan, field) for field in NUMBERS.values()} == {
        NUMBERS[key]: value for key, value in values.items()
    }


@pytest.mark.parametrize("key", sorted(FLAGS))
def test_each_flag_reaches_its_field_alone(key: str) -> None:
    plan = _plan(**{key: True})
    assert {field: getattr(plan, field) for field in FLAGS.values()} == {
        field: name == key for name, field in FLAGS.items()
    }
