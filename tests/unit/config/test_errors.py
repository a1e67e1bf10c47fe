"""Unknown keys, wrong types, strict false, and problems collected into one ConfigError."""

from __future__ import annotations

import warnings

import pytest

from slipstream.config import ConfigError, ConfigWarning, resolve

BASE = {"train_batch_size": 8}


def problems_of(config: dict, **kwargs: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve(config, world_size=kwargs.pop("world_size", 1), **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert all(p in str(info.value) for p in info.value.problems)
    return info.value.problems


def test_top_level_typo_is_an_error_with_suggestion() -> None:
    assert problems_of({**BASE, "gradient_clipp1ng": 1}) == [
        "gradient_clipp1ng: unknown key; did you mean 'gradient_clipping'?"
    ]


def test_nested_typo_names_the_dotted_path_and_suggests() -> None:
    found = problems_of({**BASE, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sz": 5}})
    assert found == [
        "zero_optimization.stage3_prefetch_bucket_sz: unknown key; "
        "did you mean 'stage3_prefetch_bucket_size'?"
    ]


def test_deeply_nested_typo() -> None:
    found = problems_of(
        {
            **BASE,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}},
        }
    )
    assert found == [
        "zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean 'pin_memory'?"
    ]


def test_key_at_the_wrong_level_points_to_its_section() -> None:
    found = problems_of({**BASE, "reduce_bucket_size": 5e8})
    assert found == [
        "reduce_bucket_size: unknown key here; did you mean 'zero_optimization.reduce_bucket_size'?"
    ]


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    (found,) = problems_of({**BASE, "fp16": {"zzzz": 1}})
    assert found.startswith("fp16.zzzz: unknown key; valid keys here are: ")
    assert "loss_scale" in found


def test_string_8_is_not_an_integer() -> None:
    assert problems_of({"train_batch_size": 8, "gradient_accumulation_steps": "8"}) == [
        "gradient_accumulation_steps: expected an integer, got the string '8'"
    ]


def test_integer_8_is_accepted() -> None:
    plan = resolve({"train_batch_size": 8, "gradient_accumulation_steps": 8}, world_size=1)
    assert plan.batch.gradient_accumulation_steps == 8


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {**BASE, "fp16": {"enabled": "true"}},
            "fp16.enabled: expected a boolean (true or false), got the string 'true'",
        ),
        (
            {**BASE, "bf16": {"enabled": 2}},  # 0 and 1 are booleans, as in DeepSpeed
            "bf16.enabled: expected a boolean (true or false), got the integer 2",
        ),
        ({**BASE, "gradient_clipping": "1.0"}, "gradient_clipping: expected a number, got the string '1.0'"),
        (
            {**BASE, "zero_optimization": {"reduce_bucket_size": 0.5}},
            "zero_optimization.reduce_bucket_size: expected an integer, got the number 0.5",
        ),
        (
            {**BASE, "zero_optimization": {"stage": 4}},
            "zero_optimization.stage: expected a number <= 3, got the integer 4",
        ),
        (
            {**BASE, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device: expected one of 'none', 'cpu' or 'nvme', "
            "got the string 'gpu'",
        ),
        ({**BASE, "fp16": 1}, "fp16: expected an object, got the integer 1"),
        ({"train_batch_size": 0}, "train_batch_size: expected a number > 0, got the integer 0"),
    ],
)
def test_wrong_types_name_the_expected_type(config: dict, expected: str) -> None:
    assert expected in problems_of(config)


@pytest.mark.parametrize(
    "fp16, fragment",
    [
        ({"loss_scale": -1}, "fp16.loss_scale: loss_scale must be a finite number >= 0"),
        ({"loss_scale": float("inf")}, "fp16.loss_scale: loss_scale must be a finite number >= 0"),
        ({"loss_scale_window": 0}, "loss_scale_window must be > 0"),
        ({"min_loss_scale": 0}, "min_loss_scale must be > 0"),
    ],
)
def test_loss_scale_rules(fp16: dict, fragment: str) -> None:
    found = problems_of({**BASE, "fp16": {"enabled": True, **fp16}})
    assert len(found) == 1 and fragment in found[0]


def test_several_problems_are_reported_together() -> None:
    found = problems_of(
        {
            "train_batch_size": "8",
            "gradient_clipp1ng": 1.0,
            "zero_optimization": {"stage": 2, "reduce_bucket_sz": 1},
            "fp16": {"enabled": True, "loss_scale": -2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}},
            "scheduler": {"type": "WarmupLRR"},
        }
    )
    assert len(found) == 6, found
    joined = "\n".join(found)
    for fragment in (
        "train_batch_size: expected an integer",
        "gradient_clipp1ng: unknown key",
        "zero_optimization.reduce_bucket_sz: unknown key",
        "fp16.loss_scale",
        "optimizer.params.max_grad_norm",
        "scheduler.type: unknown scheduler 'WarmupLRR'",
    ):
        assert fragment in joined
    with pytest.raises(ConfigError, match="6 problems in the DeepSpeed config"):
        resolve(
            {
                "train_batch_size": "8",
                "gradient_clipp1ng": 1.0,
                "zero_optimization": {"reduce_bucket_sz": 1},
                "fp16": {"enabled": True, "loss_scale": -2},
                "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}},
                "scheduler": {"type": "WarmupLRR"},
            },
            world_size=1,
        )


def test_strict_false_in_config_warns_once_per_key_and_drops() -> None:
    config = {
        **BASE,
        "strict": False,
        "gradient_clipp1ng": 2.0,
        "zero_optimization": {"stage": 1, "bogus": 1},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = resolve(config, world_size=1)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(messages) == 2
    assert messages[0].startswith("gradient_clipp1ng: unknown key; did you mean 'gradient_clipping'?")
    assert messages[1].startswith("zero_optimization.bogus: unknown key")
    assert plan.gradient_clipping == 1.0
    assert "gradient_clipp1ng" not in plan.resolved and "bogus" not in plan.resolved["zero_optimization"]


def test_strict_argument_wins_over_the_config_key() -> None:
    with pytest.warns(ConfigWarning, match="foo: unknown key"):
        resolve({**BASE, "strict": True, "foo": 1}, world_size=1, strict=False)
    with pytest.raises(ConfigError, match="foo: unknown key"):
        resolve({**BASE, "strict": False, "foo": 1}, world_size=1, strict=True)


def test_strict_false_keeps_type_errors() -> None:
    with pytest.raises(ConfigError, match="expected an integer, got the string '8'"):
        resolve({"train_batch_size": "8"}, world_size=1, strict=False)


def test_bad_arguments() -> None:
    assert problems_of(BASE, world_size=0) == [
        "world_size: expected an integer >= 1 (the data-parallel size), got 0"
    ]
    with pytest.raises(ConfigError, match="expected a dict"):
        resolve("ds.json", world_size=1)  # type: ignore[arg-type]
