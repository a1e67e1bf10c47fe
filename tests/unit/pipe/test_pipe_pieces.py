"""The pipeline's pure pieces: partitions, schedule tables, activation descriptions."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from slipstream.pipe.exchange import flatten, tensor_specs, unflatten
from slipstream.pipe.partition import partition, partition_balanced, partition_uniform
from slipstream.pipe.schedule import actions_for
from slipstream.utils.torch_versions import TorchTooOld


def _best_by_search(weights: list[int], num_parts: int) -> list[int]:
    """Every split into non-empty parts: least heaviest part, then greatest lightest part, then latest boundaries."""
    n = len(weights)
    best: tuple[tuple[int, int, list[int]], list[int]] | None = None
    for cuts in itertools.combinations(range(1, n), num_parts - 1):
        bounds = [0, *cuts, n]
        sums = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        key = (max(sums), -min(sums), [-b for b in bounds])
        if best is None or key < best[0]:
            best = (key, bounds)
    assert best is not None
    return best[1]


def test_partition_balanced_is_the_most_even_of_the_least_bottlenecked() -> None:
    # a part as light as possible among equal bottlenecks (DeepSpeed's tests/unit/utils/test_partition_balanced.py)
    assert partition_balanced([1, 1, 1, 1, 0, 1], 4) == [0, 2, 3, 5, 6]  # sums 2,1,1,1 (not 2,2,0,1)
    assert partition_balanced([1, 2, 1], 4) == [0, 1, 2, 3, 3]  # fewer items than parts: one each, then empty
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 8)
        weights = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]
        num_parts = rng.randint(1, n)
        assert partition_balanced(weights, num_parts) == _best_by_search(weights, num_parts), (weights, num_parts)


def test_partitions() -> None:
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_balanced([1, 1, 8, 1, 1], 2) == [0, 3, 5]
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    names = ["Embed", "Block", "Block", "Block", "Block", "Head"]
    assert partition("type:block", num_layers=6, num_parts=2, param_counts=[1] * 6, type_names=names) == [0, 3, 6]
    assert partition([0, 2, 6], num_layers=6, num_parts=2, param_counts=[1] * 6, type_names=names) == [0, 2, 6]
    with pytest.raises(ValueError, match="boundaries"):
        partition([0, 7], num_layers=6, num_parts=1, param_counts=[1] * 6, type_names=names)
    with pytest.raises(ValueError, match="matches no layer"):
        partition("type:conv", num_layers=6, num_parts=2, param_counts=[1] * 6, type_names=names)


@pytest.mark.parametrize(
    "schedule,chunks", [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2), ("zbv_zero_bubble", 2)]
)
def test_every_schedule_runs_each_stage_and_micro_batch_once(schedule: str, chunks: int) -> None:
    stages, micros = 4, 8
    seen: dict[str, set] = {"F": set(), "B": set(), "I": set(), "W": set()}
    try:
        tables = [actions_for(schedule, rank=r, stages=stages, chunks=chunks, micros=micros) for r in range(stages)]
    except TorchTooOld as exc:  # torch's schedule tables as torch 2.13 lays them out (docs/pipeline.md)
        pytest.skip(str(exc)[:200])
    for table in tables:
        for a in table:
            assert (a.stage, a.micro) not in seen[a.kind]
            seen[a.kind].add((a.stage, a.micro))
    every = {(s, m) for s in range(stages * chunks) for m in range(micros)}
    assert seen["F"] == every
    assert seen["B"] == every or (seen["I"] == every and seen["W"] == every)


def test_1f1b_order() -> None:
    text = " ".join(f"{a.kind}{a.micro}" for a in actions_for("1f1b", rank=0, stages=2, chunks=1, micros=3))
    assert text == "F0 F1 B0 F2 B1 B2"


def test_activation_descriptions_round_trip() -> None:
    tree = {"h": torch.ones(2, 3, requires_grad=True), "mask": (torch.zeros(4, dtype=torch.bool), None, 3), "n": "x"}
    spec, tensors = flatten(tree)
    assert [s["shape"] for s in tensor_specs(spec)] == [[2, 3], [4]]
    back = unflatten(spec, tensors)
    assert back["mask"][1:] == (None, 3) and back["n"] == "x" and back["h"] is tree["h"]
    with pytest.raises(TypeError, match="dict keys"):
        flatten({1: torch.ones(1)})
