"""The elasticity section: DeepSpeed's documented examples pinned, its errors, and its effect on the batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slipstream.config import ConfigError, resolve
from slipstream.config.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

DS = "0.19.8"


@pytest.fixture()
def section() -> dict[str, Any]:
    return {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
            "max_gpus": 1500, "min_time": 20, "version": 0.1}


def test_the_10k_example(section: dict[str, Any]) -> None:
    batch, valid = compute_elastic_config({"elasticity": section}, DS)
    assert (batch, len(valid)) == (9792, 23)
    for count in valid:  # every count trains the batch with some acceptable micro batch
        assert batch % count == 0 and any(batch // count % m == 0 for m in section["micro_batch_sizes"])
    assert compute_elastic_config({"elasticity": section}, DS, world_size=64) == (9792, valid, 17)


def test_a_world_size_outside_the_valid_counts_is_named(section: dict[str, Any]) -> None:
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"world size 128 .* use one of \[32, 34, "):
        compute_elastic_config({"elasticity": section}, DS, world_size=128)


@pytest.mark.parametrize("changes, world, micro", [
    ({"max_train_batch_size": 32, "micro_batch_sizes": [1, 2, 3, 7], "min_gpus": 1}, 4, 3),  # lcm 42 > 32 dropped
])
def test_the_micro_batch_for_a_world_size(section: dict[str, Any], changes: dict, world: int, micro: int) -> None:
    batch, _, chosen = compute_elastic_config({"elasticity": {**section, **changes}}, DS, world_size=world)
    assert chosen == micro and batch <= changes["max_train_batch_size"]


def test_the_batch_stays_within_the_maximum(section: dict[str, Any]) -> None:
    config = {"elasticity": {**section, "max_train_batch_size": 100, "micro_batch_sizes": [8, 10, 12], "min_gpus": 1}}
    assert compute_elastic_config(config, DS)[0] <= 100


@pytest.mark.parametrize("parallel, micro, expected", [(1, [4, 8], 4), (2, [4, 8], 8), (4, [4, 8], 8), (2, [8], 8)])
def test_version_0_2_chooses_the_micro_batch_per_data_parallel_rank(section: dict[str, Any], parallel: int,
                                                                    micro: list[int], expected: int) -> None:
    config = {"elasticity": {**section, "version": 0.2, "model_parallel_size": parallel, "num_gpus_per_node": 8,
                             "max_train_batch_size": 64, "micro_batch_sizes": micro, "min_gpus": 16,
                             "max_gpus": 16}}
    batch, _, chosen = compute_elastic_config(config, DS, world_size=16)
    assert chosen == expected and batch // (16 // parallel) % chosen == 0


@pytest.mark.parametrize("changes, match", [
    ({"enabled": False}, "elasticity.enabled"),
    ({"version": 0.3}, "elasticity.version"),
    ({"model_parallel_size": 4, "num_gpus_per_node": 8}, "needs version 0.2"),
    ({"version": 0.2, "model_parallel_size": 16, "num_gpus_per_node": 8}, "not divisible"),
    ({"micro_batch_sizes": [1, 4, -1]}, "micro_batch_sizes"),
    ({"micro_batch_sizes": 5}, "micro_batch_sizes"),
    ({"micro_batch_sizes": [2, 0.5, 4]}, "micro_batch_sizes"),
    ({"min_gpus": -1}, "elasticity.min_gpus"),
    ({"max_gpus": -1}, "elasticity.max_gpus"),
])
def test_bad_sections_are_named(section: dict[str, Any], changes: dict, match: str) -> None:
    with pytest.raises(ElasticityError, match=match):
        compute_elastic_config({"elasticity": {**section, **changes}}, DS, world_size=16)


def test_missing_keys_and_old_targets(section: dict[str, Any]) -> None:
    for key in ("max_train_batch_size", "micro_batch_sizes"):
        with pytest.raises(ElasticityConfigError, match="required"):
            compute_elastic_config({"elasticity": {k: v for k, v in section.items() if k != key}}, DS)
    with pytest.raises(ElasticityError, match="predates elasticity"):
        compute_elastic_config({"elasticity": section}, "0.2")


def test_resolve_applies_the_elastic_batch(section: dict[str, Any]) -> None:
    plan = resolve({"elasticity": section}, world_size=64)
    batch = plan.batch
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == (9792, 17, 9)
    assert all(source.startswith("elasticity") for source in batch.sources.values())
    with pytest.raises(ConfigError, match=r"elasticity: world size 128 .* use one of"):
        resolve({"elasticity": section}, world_size=128)


def test_batch_keys_beside_elasticity_need_the_override(section: dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="train_batch_size: set together with elasticity.enabled"):
        resolve({"train_batch_size": 2, "elasticity": section}, world_size=64)
    ignoring = {**section, "ignore_non_elastic_batch_info": True}
    assert resolve({"train_batch_size": 2, "elasticity": ignoring}, world_size=64).batch.train_batch_size == 9792
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({"elasticity": {**section, "max_train_batch_size": 27}}))
    with pytest.raises(ConfigError, match=r"elasticity.max_train_batch_size: 10000 here, but the scheduler's copy"):
        resolve({"elasticity": section}, world_size=64)


def test_the_elastic_command(section: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"elasticity": section}))
    result = subprocess.run([sys.executable, "-m", "slipstream.cli.main", "elastic", "-c", str(path), "-w", "64",
                             "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert (figures["train_batch_size"], figures["micro_batch_size"], figures["gradient_accumulation_steps"]) == (
        9792, 17, 9)
    bad = subprocess.run([sys.executable, "-m", "slipstream.cli.main", "elastic", "-c", str(path), "-w", "128"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "use one of [32, 34" in bad.stderr


def test_initialize_needs_the_same_keys_as_compute_elastic_config(section: dict[str, Any]) -> None:
    """The schema's defaults fill every field, so the keys DeepSpeed requires are checked on what the user set."""
    partial = {k: v for k, v in section.items() if k != "micro_batch_sizes"}
    with pytest.raises(ConfigError, match="micro_batch_sizes are required"):
        resolve({"elasticity": partial}, world_size=64)
