"""The batch triple (DeepSpeed's `_set_batch_related_parameters`): any two derive the third."""

from __future__ import annotations

import pytest

from slipstream.config import ConfigError, resolve

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@pytest.mark.parametrize(
    "given, ws, expected, derived",
    [
        ({TBS: 32, MICRO: 4}, 2, (32, 4, 4), {GAS: "derived: 32 / (4 * 2)"}),
        ({TBS: 32, GAS: 4}, 2, (32, 4, 4), {MICRO: "derived: 32 / (4 * 2)"}),
        ({MICRO: 4, GAS: 4}, 2, (32, 4, 4), {TBS: "derived: 4 * 4 * 2"}),
        ({TBS: 8}, 1, (8, 8, 1), {MICRO: "derived: 8 / 1", GAS: "derived: 1 (only train_batch_size given)"}),
        ({TBS: 16}, 4, (16, 4, 1), {MICRO: "derived: 16 / 4"}),
        (
            {MICRO: 3},
            4,
            (12, 3, 1),
            {TBS: "derived: 3 * 1 * 4", GAS: "derived: 1 (no train_batch_size given)"},
        ),
        ({TBS: 16, MICRO: 2, GAS: 4}, 2, (16, 2, 4), {}),
    ],
)
def test_derivations(given: dict, ws: int, expected: tuple, derived: dict) -> None:
    batch = resolve(given, world_size=ws).batch
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == expected
    assert batch.world_size == ws
    for key in given:
        assert batch.sources[key] == "given"
    for key, text in derived.items():
        assert batch.sources[key] == text
    assert set(batch.sources) == {TBS, MICRO, GAS}


def test_inconsistent_triple_names_world_size_and_two_fixes() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({TBS: 8, MICRO: 2, GAS: 1}, world_size=2)
    (problem,) = info.value.problems
    assert problem == (
        "train_batch_size: 8 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 1 "
        "* world_size 2 = 4; set train_batch_size to 4, or gradient_accumulation_steps to 2"
    )


def test_inconsistent_triple_suggests_micro_batch_when_gas_cannot_fit() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({TBS: 12, MICRO: 8, GAS: 3}, world_size=1)
    assert info.value.problems[0].endswith(
        "set train_batch_size to 24, or train_micro_batch_size_per_gpu to 4"
    )


def test_inconsistent_triple_with_no_integral_second_fix() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({TBS: 7, MICRO: 2, GAS: 2}, world_size=1)
    assert info.value.problems[0].endswith(
        "set train_batch_size to 4, or remove gradient_accumulation_steps and set train_batch_size to a "
        "multiple of 2"
    )


@pytest.mark.parametrize(
    "given, ws, fragment",
    [
        (
            {TBS: 10, MICRO: 4},
            1,
            "train_batch_size: 10 is not divisible by train_micro_batch_size_per_gpu * world_size "
            "= 4 * 1 = 4, so gradient_accumulation_steps cannot be derived",
        ),
        (
            {TBS: 10, GAS: 3},
            1,
            "train_batch_size: 10 is not divisible by gradient_accumulation_steps * world_size "
            "= 3 * 1 = 3, so train_micro_batch_size_per_gpu cannot be derived",
        ),
        ({TBS: 6}, 4, "train_batch_size: 6 is not divisible by world_size = 4"),
        ({TBS: 4, MICRO: 8}, 1, "train_batch_size: 4 is not divisible by"),
    ],
)
def test_non_divisible_derivations_name_the_numbers(given: dict, ws: int, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(given, world_size=ws)
    (problem,) = info.value.problems
    assert problem.startswith(fragment), problem


@pytest.mark.parametrize("given", [{}, {GAS: 4}])
def test_neither_batch_size_given_is_an_error(given: dict) -> None:
    with pytest.raises(
        ConfigError, match="either train_batch_size or train_micro_batch_size_per_gpu needs to be"
    ):
        resolve(given, world_size=1)


def test_batch_plan_is_frozen() -> None:
    batch = resolve({TBS: 8}, world_size=1).batch
    with pytest.raises(AttributeError):
        batch.train_batch_size = 4  # type: ignore[misc]


def test_resolved_holds_the_derived_triple() -> None:
    resolved = resolve({MICRO: 2, GAS: 3}, world_size=2).resolved
    assert (resolved[TBS], resolved[MICRO], resolved[GAS]) == (12, 2, 3)
