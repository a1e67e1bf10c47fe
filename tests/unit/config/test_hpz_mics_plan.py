"""zero_hpz_partition_size and mics_shard_size reach their Stage3Plan fields; together, or below stage 3, they are
refused or reported by name; MiCS_Init refuses a config without mics_shard_size."""

from __future__ import annotations

import pytest

from slipstream.config.errors import ConfigError
from slipstream.config.resolve import resolve


def _resolve(stage: int = 3, **zero: object):  # type: ignore[no-untyped-def]
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, **zero}}
    return resolve(config, world_size=4)


def test_the_keys_reach_their_fields() -> None:
    plain = _resolve().zero.stage3
    assert (plain.secondary_shard_size, plain.shard_size) == (1, None)
    hpz = _resolve(zero_hpz_partition_size=2).zero.stage3
    assert (hpz.secondary_shard_size, hpz.shard_size) == (2, None)
    mics = _resolve(mics_shard_size=2).zero.stage3
    assert (mics.secondary_shard_size, mics.shard_size) == (1, 2)
    assert _resolve(mics_shard_size=0).zero.stage3.shard_size is None
    plan = _resolve(mics_shard_size=2, mics_hierarchical_params_gather=True)
    assert plan.zero.stage3.hierarchical_gather and not mics.hierarchical_gather
    assert "zero_optimization.mics_hierarchical_params_gather" not in plan.unimplemented
    plain = _resolve(mics_hierarchical_params_gather=True)  # without MiCS there is no shard group to gather over
    assert "zero_optimization.mics_hierarchical_params_gather" in plain.unimplemented
    assert not plain.zero.stage3.hierarchical_gather


def test_hpz_with_mics_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="zero_hpz_partition_size: 2 together with mics_shard_size 2"):
        _resolve(zero_hpz_partition_size=2, mics_shard_size=2)


@pytest.mark.parametrize("key", ["zero_hpz_partition_size", "mics_shard_size"])
def test_below_stage_3_the_keys_are_reported(key: str) -> None:
    assert f"zero_optimization.{key}" in _resolve(stage=2, **{key: 2}).unimplemented
    assert f"zero_optimization.{key}" not in _resolve(stage=3, **{key: 2}).unimplemented


def test_mics_init_refuses_a_config_without_mics_shard_size() -> None:
    from slipstream.runtime.zero.mics import MiCS_Init

    from slipstream.config.plan import Stage3Plan

    plan: Stage3Plan = _resolve().zero.stage3
    with pytest.raises(ValueError, match="mics_shard_size > 0"):
        MiCS_Init._check_plan(object.__new__(MiCS_Init), plan)
    MiCS_Init._check_plan(object.__new__(MiCS_Init), _resolve(mics_shard_size=2).zero.stage3)
