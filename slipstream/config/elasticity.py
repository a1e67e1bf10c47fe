"""Elastic batch sizes: DeepSpeed's `elasticity` section and its algorithm (versions 0.1 and 0.2).

Given acceptable micro batch sizes and a largest acceptable global batch, choose one global batch size that
as many GPU counts as possible can train unchanged (micro batch x accumulation x world), so a job can be
rescheduled onto any of those counts without changing its convergence.

Version 0.1: candidate global batches are each micro batch size, and their least common multiple, scaled by
the largest highly composite number that keeps them within `max_train_batch_size` (bases above the limit are
dropped). For each candidate, the valid GPU counts are every divisor (within `min_gpus`..`max_gpus`) of
`candidate / micro` for every micro batch that divides it. The candidate with the most valid counts wins; a
tie goes to the larger batch (`prefer_larger_batch`, else the smaller).
Version 0.2 works per node: the 0.1 search runs on the data-parallel ranks of one node
(`num_gpus_per_node / model_parallel_size`), then scales back; a world size outside the result gets the
largest batch its data-parallel size can take.
For a given world size the micro batch is the largest acceptable one dividing `batch / world`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from slipstream.config.errors import pydantic_problems
from slipstream.config.schema.misc import ElasticityConfig

__all__ = [
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "ElasticResult",
    "compute_elastic_config",
    "elastic_result",
    "elasticity_enabled",
    "parse_section",
]

MINIMUM_DEEPSPEED_VERSION = (0, 3, 8)
LATEST_VERSION = 0.2
HIGHLY_COMPOSITE = (
    1,
    2,
    4,
    6,
    12,
    24,
    36,
    48,
    60,
    120,
    180,
    240,
    360,
    720,
    840,
    1260,
    1680,
    2520,
    5040,
    7560,
    10080,
    15120,
    20160,
    25200,
    27720,
    45360,
    50400,
    55440,
    83160,
    110880,
    166320,
    221760,
    277200,
    332640,
    498960,
    554400,
    665280,
    720720,
)


class ElasticityError(ValueError):
    """The elasticity section cannot be used as given."""


class ElasticityConfigError(ElasticityError):
    """A missing, disabled or invalid elasticity setting."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the GPU counts the elastic batch size allows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticResult:
    """What the elasticity section decides."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]
    micro_batch_size: int | None = None
    """For the world size asked about (None when none was given)."""


def elasticity_enabled(ds_config: dict[str, object]) -> bool:
    section = ds_config.get("elasticity")
    return isinstance(section, dict) and section.get("enabled", False) is True


def parse_section(raw: object) -> ElasticityConfig:
    """A raw `elasticity` dict through the config schema (its defaults and types are the only ones)."""
    try:
        return ElasticityConfig.model_validate(raw)
    except ValidationError as exc:
        raise ElasticityConfigError("; ".join(pydantic_problems(exc, ("elasticity",)))) from None


def _settings(section: ElasticityConfig) -> dict[str, Any]:
    """The values the search uses; what the schema cannot say is checked here (errors name `elasticity.<key>`)."""
    if not {"max_train_batch_size", "micro_batch_sizes"} <= section.model_fields_set:
        raise ElasticityConfigError(
            "elasticity: max_train_batch_size and micro_batch_sizes are required with "
            "enabled: true (e.g. 2000 and [2, 4, 6])"
        )
    micro = list(section.micro_batch_sizes)
    if not micro or min(micro) < 1:
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes: expected a non-empty list of positive integers, got {micro!r}"
        )
    if max(micro) > section.max_train_batch_size:
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes: {max(micro)} is larger than "
            f"max_train_batch_size {section.max_train_batch_size}"
        )
    return {
        "max_train_batch_size": section.max_train_batch_size,
        "micro_batch_sizes": micro,
        "min_gpus": section.min_gpus,
        "max_gpus": section.max_gpus,
        "num_gpus_per_node": section.num_gpus_per_node,
        "model_parallel_size": section.model_parallel_size,
        "prefer_larger": section.prefer_larger_batch,
        "version": float(section.version),
    }


def _largest_hcn_at_most(value: int) -> int:
    return max(h for h in HIGHLY_COMPOSITE if h <= value)


def _candidates(micro: list[int], limit: int) -> list[int]:
    bases = [*micro, math.lcm(*micro)]
    return sorted({base * _largest_hcn_at_most(limit // base) for base in bases if base <= limit})


def _valid_counts(batch: int, micro: list[int], low: int, high: int) -> list[int]:
    counts: set[int] = set()
    for size in micro:
        if batch % size:
            continue
        most = batch // size
        counts.update(d for d in range(max(1, low), min(most, high) + 1) if most % d == 0)
    return sorted(counts)


def _search_v01(micro: list[int], limit: int, low: int, high: int, prefer_larger: bool) -> tuple[int, list[int]]:
    best, best_counts = min(micro), list[int]()
    for batch in _candidates(micro, limit):
        counts = _valid_counts(batch, micro, low, high)
        better_tie = (batch > best) if prefer_larger else (batch < best)
        if len(counts) > len(best_counts) or (len(counts) == len(best_counts) and better_tie):
            best, best_counts = batch, counts
    return best, best_counts


def _micro_for(batch: int, data_parallel: int, micro: list[int]) -> int | None:
    fitting = [m for m in micro if batch // data_parallel % m == 0]
    return max(fitting) if fitting else None


def _search_v02(s: dict[str, Any], world_size: int) -> tuple[int, list[int]]:
    per_node, parallel = s["num_gpus_per_node"], s["model_parallel_size"]
    if per_node % parallel:
        raise ElasticityConfigError(
            f"elasticity.num_gpus_per_node: {per_node} is not divisible by model_parallel_size {parallel}"
        )
    dp_per_node = per_node // parallel
    batch, nodes = _search_v01(
        s["micro_batch_sizes"],
        s["max_train_batch_size"] // dp_per_node,
        max(1, s["min_gpus"] // per_node),
        max(1, s["max_gpus"] // per_node),
        s["prefer_larger"],
    )
    batch, valid = batch * dp_per_node, [n * dp_per_node for n in nodes]
    data_parallel = world_size // parallel
    if data_parallel in valid:
        return batch, valid
    # this world is not in the searched set: the largest batch its data-parallel size can take
    sizes = [m * data_parallel * (s["max_train_batch_size"] // (m * data_parallel)) for m in s["micro_batch_sizes"]]
    return (max(sizes) if s["prefer_larger"] else min(sizes)), [data_parallel]


def _check_version(target: str, version: float, parallel: int) -> None:
    parts = [int(p) for p in target.split("+")[0].split(".")[:3] if p.isdigit()]
    if tuple(parts + [0] * (3 - len(parts))) < MINIMUM_DEEPSPEED_VERSION:
        raise ElasticityError(f"target DeepSpeed version {target} predates elasticity (needs >= 0.3.8)")
    if version > LATEST_VERSION:
        raise ElasticityConfigError(
            f"elasticity.version: {version} is newer than the latest supported ({LATEST_VERSION})"
        )
    if version not in (0.1, 0.2):
        raise ElasticityConfigError(f"elasticity.version: expected 0.1 or 0.2, got {version}")
    if parallel > 1 and version != 0.2:
        raise ElasticityConfigError(f"elasticity.model_parallel_size: {parallel} needs version 0.2")


def elastic_result(section: ElasticityConfig, *, world_size: int = 0, target_version: str = "0.19.0") -> ElasticResult:
    """The batch size and valid world sizes of an enabled `elasticity` section (and the micro batch for
    `world_size` when given). Errors name the key and what is allowed."""
    s = _settings(section)
    _check_version(target_version, s["version"], s["model_parallel_size"])
    if s["version"] == 0.2:
        current = world_size or int(os.environ.get("WORLD_SIZE", "0") or 0)
        if current <= 0:
            raise ElasticityConfigError(
                "elasticity version 0.2 needs the world size: pass world_size or set WORLD_SIZE"
            )
        batch, valid = _search_v02(s, current)
    else:
        batch, valid = _search_v01(
            s["micro_batch_sizes"], s["max_train_batch_size"], s["min_gpus"], s["max_gpus"], s["prefer_larger"]
        )
    if world_size <= 0:
        return ElasticResult(train_batch_size=int(batch), valid_world_sizes=tuple(valid))
    data_parallel = world_size // s["model_parallel_size"]
    if data_parallel not in valid:
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} is not one the elastic batch size {batch} allows; use one of {valid}"
        )
    micro = _micro_for(batch, data_parallel, sorted(set(s["micro_batch_sizes"])))
    if micro is None:
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes: none of {s['micro_batch_sizes']} divides {batch} / {data_parallel} per rank"
        )
    return ElasticResult(train_batch_size=int(batch), valid_world_sizes=tuple(valid), micro_batch_size=micro)


def compute_elastic_config(
    ds_config: dict[str, object], target_deepspeed_version: str, world_size: int = 0, return_microbatch: bool = False
) -> tuple[Any, ...]:
    """DeepSpeed's `deepspeed.elasticity.compute_elastic_config`: (batch, valid GPU counts[, micro batch])."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"ds_config: expected a dict, got {type(ds_config).__name__}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("elasticity: the section is missing; add it to run an elastic job")
    if not elasticity_enabled(ds_config):
        raise ElasticityConfigError("elasticity.enabled: elasticity is disabled; set it to true")
    if return_microbatch and world_size <= 0:
        world_size = int(os.environ.get("WORLD_SIZE", "0") or 0)
        if world_size <= 0:
            raise ElasticityConfigError("return_microbatch needs the world size: pass world_size or set WORLD_SIZE")
    section = parse_section(ds_config["elasticity"])
    result = elastic_result(section, world_size=world_size, target_version=target_deepspeed_version)
    valid = list(result.valid_world_sizes)
    if world_size > 0:
        return result.train_batch_size, valid, result.micro_batch_size
    return result.train_batch_size, valid
