"""A top-level dotted key ("zero_optimization.reduce_bucket_size", as TRL's `prepare_deepspeed` writes into the
config it passes to `deepspeed.initialize`) is ignored with a warning, strict or not, as DeepSpeed 0.19 ignores
it (its config keeps the nested section's values); any other unknown top-level key is still an error."""

from __future__ import annotations

import pytest

from slipstream.config.errors import ConfigError, ConfigWarning
from slipstream.config.resolve import resolve

BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}


def test_dotted_top_level_key_is_ignored_with_a_warning() -> None:
    config = {**BASE, "zero_optimization.reduce_bucket_size": 7, "zero_optimization.stage3_prefetch_bucket_size": 9}
    with pytest.warns(ConfigWarning, match=r'zero_optimization.reduce_bucket_size: .*"zero_optimization": '):
        plan = resolve(config, world_size=2)
    assert plan.zero.reduce_bucket_size == 1000


def test_other_unknown_top_level_keys_still_fail() -> None:
    with pytest.raises(ConfigError, match="nonsense.reduce_bucket_size"):
        resolve({**BASE, "nonsense.reduce_bucket_size": 7}, world_size=2)
