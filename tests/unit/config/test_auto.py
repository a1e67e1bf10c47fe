"""HF-style "auto" values: what resolve() fills in, and what it refuses."""

from __future__ import annotations

import pytest

from slipstream.config import ConfigError, resolve

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
CALLER = '"auto" must be filled in by the caller (e.g. Transformers\' Trainer) or replaced with a value'


def test_auto_batch_member_is_derived() -> None:
    batch = resolve({TBS: "auto", MICRO: 4, GAS: 2}, world_size=2).batch
    assert batch.train_batch_size == 16
    assert batch.sources[TBS] == 'derived: 4 * 2 * 2 (was "auto")'


def test_two_auto_members_are_derived_by_deepspeed_rules() -> None:
    batch = resolve({TBS: "auto", MICRO: 4, GAS: "auto"}, world_size=2).batch
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == (8, 4, 1)
    assert batch.sources[GAS].endswith('(was "auto")')


def test_underivable_auto_batch_names_the_keys() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({TBS: "auto", MICRO: "auto", GAS: "auto"}, world_size=1)
    (problem,) = info.value.problems
    assert problem.startswith(f'{TBS}, {MICRO}, {GAS}: "auto" cannot be derived')


def test_zero_bucket_autos_use_hidden_size() -> None:
    config = {
        TBS: 8,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    plan = resolve(config, world_size=1, hidden_size=1024)
    assert plan.zero.reduce_bucket_size == 1024 * 1024
    assert plan.zero.stage3 is not None
    assert plan.zero.stage3.prefetch_numel == int(0.9 * 1024 * 1024)
    assert plan.zero.stage3.persistence_threshold == 10 * 1024
    assert plan.resolved["zero_optimization"]["reduce_bucket_size"] == 1024 * 1024


def test_zero_bucket_auto_without_hidden_size_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        resolve(
            {TBS: 8, "zero_optimization": {"reduce_bucket_size": "auto", "prefetch_bucket_size": "auto"}},
            world_size=1,
        )
    need = '"auto" needs the model\'s hidden size; pass hidden_size=... to resolve() or set a number'
    assert info.value.problems == [
        f"zero_optimization.reduce_bucket_size: {need}",
        f"zero_optimization.prefetch_bucket_size: {need}",
    ]


@pytest.mark.parametrize(
    "config, key",
    [
        ({TBS: 8, "gradient_clipping": "auto"}, "gradient_clipping"),
        ({TBS: 8, "fp16": {"enabled": "auto"}}, "fp16.enabled"),
        ({TBS: 8, "bf16": {"enabled": "auto"}}, "bf16.enabled"),
        (
            {TBS: 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.99]}}},
            "optimizer.params.lr",
        ),
        (
            {TBS: 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
            "scheduler.params.warmup_num_steps",
        ),
        (
            {TBS: 8, "zero_optimization": {"allgather_bucket_size": "auto"}},
            "zero_optimization.allgather_bucket_size",
        ),
    ],
)
def test_other_autos_are_errors_naming_the_key(config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(config, world_size=1, hidden_size=64)
    assert info.value.problems == [f"{key}: {CALLER}"]


def test_all_auto_problems_come_together() -> None:
    config = {
        TBS: "auto",
        MICRO: "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    }
    with pytest.raises(ConfigError) as info:
        resolve(config, world_size=1)
    assert len(info.value.problems) == 4


def test_auto_that_is_a_real_deepspeed_value_is_kept() -> None:
    plan = resolve(
        {
            TBS: 8,
            "pipeline": {"stages": "auto"},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "zenflow": {"select_strategy": "auto"},
            },
        },
        world_size=1,
    )
    assert plan.resolved["pipeline"]["stages"] == "auto"
    assert plan.resolved["zero_optimization"]["zenflow"]["select_strategy"] == "auto"


def test_hf_trainer_style_config() -> None:
    """A typical Transformers template after the Trainer filled in everything except the hidden-size keys."""
    config = {
        "fp16": {
            "enabled": False,
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500},
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
        },
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 4,
        "wall_clock_breakdown": False,
    }
    plan = resolve(config, world_size=2, hidden_size=768)
    assert plan.batch.train_batch_size == 16
    assert plan.zero.reduce_bucket_size == 768**2
    assert plan.optimizer is not None and plan.optimizer.name == "adamw"
    assert plan.zero.offload_optimizer.on_host
    # Transformers' sample config sets a knob whose behaviour is fixed here: reported, not silently dropped
    assert set(plan.unimplemented) == {"zero_optimization.allgather_bucket_size"}
    assert plan.zero.overlap_comm is True
