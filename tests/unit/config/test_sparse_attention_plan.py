"""The `sparse_attention` section: checked and completed with each mode's defaults as DeepSpeed's config reader
did (`DeepSpeedConfig(config).sparse_attention`), and turned into the layout object by `sparsity_config`."""

from __future__ import annotations

import pytest

from slipstream.compat.ds_config import DeepSpeedConfig
from slipstream.config.errors import ConfigError
from slipstream.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, sparsity_config


def _read(section: dict | None) -> dict | None:
    config: dict = {"train_batch_size": 2}
    if section is not None:
        config["sparse_attention"] = section
    return DeepSpeedConfig(config).sparse_attention


def test_each_mode_is_completed_with_deepspeeds_defaults() -> None:
    assert _read(None) is None
    assert _read({"block": 32}) == {  # no mode: "fixed", as DeepSpeed
        "mode": "fixed", "block": 32, "different_layout_per_head": False, "num_local_blocks": 4,
        "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
        "num_different_global_patterns": 1,
    }
    assert _read({"mode": "dense"}) == {"mode": "dense", "block": 16}
    assert _read({"mode": "bigbird", "num_global_blocks": 2}) == {
        "mode": "bigbird", "block": 16, "different_layout_per_head": False, "num_random_blocks": 0,
        "num_sliding_window_blocks": 3, "num_global_blocks": 2,
    }
    assert _read({"mode": "variable"})["local_window_blocks"] == [4]  # type: ignore[index]
    assert _read({"mode": "bslongformer"})["global_block_indices"] == [0]  # type: ignore[index]


def test_a_bad_mode_or_key_names_what_is_valid() -> None:
    with pytest.raises(ConfigError, match=r"sparse_attention.mode: 'sparse' is not a layout mode; use one of"):
        _read({"mode": "sparse"})
    with pytest.raises(ConfigError, match=r"num_local_blocks is not a key of mode 'bigbird'; its keys are"):
        _read({"mode": "bigbird", "num_local_blocks": 2})


def test_the_section_builds_its_layout() -> None:
    fixed = sparsity_config(_read({"block": 16, "num_local_blocks": 2}), num_heads=4)  # type: ignore[arg-type]
    assert type(fixed) is FixedSparsityConfig and fixed.num_heads == 4 and fixed.num_local_blocks == 2
    reference = FixedSparsityConfig(num_heads=4, block=16, num_local_blocks=2)
    assert fixed.make_layout(128).equal(reference.make_layout(128))
    bigbird = sparsity_config(_read({"mode": "bigbird", "num_global_blocks": 2}), num_heads=2)  # type: ignore[arg-type]
    assert type(bigbird) is BigBirdSparsityConfig and bigbird.num_random_blocks == 0 and bigbird.num_global_blocks == 2
    with pytest.raises(ValueError, match="not a layout mode"):
        sparsity_config({"mode": "nope"}, num_heads=2)
