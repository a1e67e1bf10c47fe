"""DeepSpeed 0.19 defaults, aliases and legacy spellings of the schema (slipstream/config/schema/)."""

from __future__ import annotations

import sys
import warnings

import pytest

from slipstream.config import ConfigError, ConfigWarning, CpuTarget, resolve
from slipstream.config.schema import DeepSpeedConfig
from slipstream.config.schema.zero import ZeroConfig

BASE = {"train_batch_size": 8}


def test_top_level_defaults_match_deepspeed() -> None:
    cfg = DeepSpeedConfig.model_validate({})
    assert cfg.gradient_clipping == 1.0
    assert cfg.prescale_gradients is False
    assert cfg.gradient_predivide_factor == 1.0
    assert cfg.steps_per_print is None
    assert cfg.wall_clock_breakdown is False
    assert cfg.dataloader_drop_last is False
    assert cfg.zero_allow_untested_optimizer is False
    assert cfg.zero_force_ds_cpu_optimizer is True
    assert cfg.gradient_allreduce_op == "mean"
    assert cfg.strict is True


def test_zero_defaults_match_deepspeed() -> None:
    zero = DeepSpeedConfig.model_validate({}).zero_optimization
    assert zero.stage == 0
    assert zero.reduce_bucket_size == 500_000_000
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.overlap_comm is False  # unset: filled with stage >= 2 (DeepSpeed: stage == 3)
    assert DeepSpeedConfig.model_validate({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert zero.contiguous_gradients is True and zero.reduce_scatter is True
    assert zero.prefetch_bucket_size == 50_000_000
    assert zero.param_persistence_threshold == 100_000
    assert zero.model_persistence_threshold == sys.maxsize
    assert zero.max_live_parameters == 1_000_000_000 and zero.max_reuse_distance == 1_000_000_000
    assert zero.sub_group_size == 1_000_000_000
    assert zero.mics_shard_size == -1
    assert zero.offload_optimizer is None and zero.offload_param is None


def test_precision_defaults_match_deepspeed() -> None:
    cfg = DeepSpeedConfig.model_validate({})
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (
        False,
        0,
        16,
        1000,
    )
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (2, False, 1)
    assert cfg.bf16.enabled is False and cfg.bf16.check_grad_overflow is True


def test_offload_and_monitor_defaults() -> None:
    cfg = DeepSpeedConfig.model_validate(
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    )
    off = cfg.zero_optimization.offload_optimizer
    assert (off.buffer_count, off.pin_memory, off.ratio, off.fast_init) == (4, True, 1.0, False)
    par = cfg.zero_optimization.offload_param
    assert (par.buffer_count, par.buffer_size, par.max_in_cpu, par.pin_memory) == (
        5,
        100_000_000,
        1_000_000_000,
        True,
    )
    assert cfg.tensorboard.job_name == "DeepSpeedJobName" and cfg.tensorboard.output_path == ""
    assert cfg.wandb.project == "deepspeed"
    assert cfg.checkpoint.tag_validation == "WARN"
    assert cfg.aio.block_size == 1_048_576 and cfg.aio.queue_depth == 8


def test_plan_defaults() -> None:
    plan = resolve(BASE, world_size=1)
    assert plan.gradient_clipping == 1.0
    assert plan.resolved["zero_optimization"]["overlap_comm"] is False and plan.zero.stage == 0
    assert plan.precision.param_dtype == "fp32" and plan.precision.loss_scale is None
    assert plan.optimizer is None and plan.scheduler is None
    assert (
        plan.logging.monitor.csv_output_path is None and plan.logging.monitor.tensorboard_output_path is None
    )
    assert plan.unimplemented == ()


def test_sub_group_size_reaches_the_plan_as_given_zero_included() -> None:
    """0 is DeepSpeed's one-parameter sub-groups (stage3.py, _create_fp16_sub_groups), not the default."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    given = resolve({**BASE, "zero_optimization": {**zero, "sub_group_size": 0}}, world_size=1)
    unset = resolve({**BASE, "zero_optimization": zero}, world_size=1)
    assert given.zero.stage3 is not None and given.zero.stage3.sub_group_numel == 0
    assert unset.zero.stage3 is not None and unset.zero.stage3.sub_group_numel == ZeroConfig().sub_group_size


@pytest.mark.parametrize("stage, expected", [(0, False), (1, False), (2, True), (3, True)])
def test_overlap_comm_defaults_true_from_stage_2(stage: int, expected: bool) -> None:
    plan = resolve({**BASE, "zero_optimization": {"stage": stage}}, world_size=1)
    assert plan.resolved["zero_optimization"]["overlap_comm"] is expected


def test_overlap_comm_given_wins() -> None:
    plan = resolve({**BASE, "zero_optimization": {"stage": 3, "overlap_comm": False}}, world_size=1)
    assert plan.resolved["zero_optimization"]["overlap_comm"] is False
    assert plan.zero.overlap_comm is False and plan.unimplemented == ()


@pytest.mark.parametrize("stage, reported", [(0, True), (1, False), (2, False), (3, False)])
def test_overlap_comm_true_is_reported_only_at_stage_0(stage: int, reported: bool) -> None:
    """Stage 0 all-reduces at the step: overlap_comm has nothing to overlap there (DeepSpeed ignores it too)."""
    plan = resolve({**BASE, "zero_optimization": {"stage": stage, "overlap_comm": True}}, world_size=1)
    assert plan.zero.overlap_comm is True
    assert ("zero_optimization.overlap_comm" in plan.unimplemented) is reported


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_quantized_weight_keys_act_at_stage_3(stage: int) -> None:
    names = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
    plan = resolve({**BASE, "zero_optimization": {"stage": stage, **dict.fromkeys(names, True)}}, world_size=1)
    assert {f"zero_optimization.{name}" for name in names}.isdisjoint(plan.unimplemented) is (stage == 3)
    if stage == 3:
        assert plan.zero.stage3 is not None
        assert plan.zero.stage3.quantized_weights and plan.zero.stage3.quantized_frozen_weights
        assert plan.zero.stage3.quantized_gradients


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, "fp32"),
        ({"bf16": {"enabled": True}}, "fp32"),  # gradients accumulate in fp32 here, and travel so
        ({"data_types": {"grad_accum_dtype": "bf16"}}, "bf16"),
        ({"bf16": {"enabled": True}, "communication_data_type": "bf16"}, "bf16"),
        ({"communication_data_type": "fp16"}, "fp16"),
        ({"communication_data_type": "torch.float32"}, "fp32"),
    ],
)
def test_communication_data_type_is_the_reduce_dtype(config: dict, expected: str) -> None:
    plan = resolve({**BASE, **config}, world_size=1)
    assert plan.zero.reduce_dtype == expected
    assert "communication_data_type" not in plan.unimplemented


@pytest.mark.parametrize(
    "name, field, value",
    [
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 1234),
        ("prefetch_bucket_size", "prefetch_bucket_size", 1234),
        ("stage3_param_persistence_threshold", "param_persistence_threshold", 77),
        ("stage3_max_live_parameters", "max_live_parameters", 5),
        ("stage3_max_reuse_distance", "max_reuse_distance", 6),
        ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", True),
        ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save", True),
        ("stage3_model_persistence_threshold", "model_persistence_threshold", 9),
        ("stage3_module_granularity_threshold", "module_granularity_threshold", 3),
        ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", True),
        ("stage3_allgather_sequential", "allgather_sequential", True),
    ],
)
def test_stage3_aliases(name: str, field: str, value: object) -> None:
    cfg = DeepSpeedConfig.model_validate({"zero_optimization": {"stage": 3, name: value}})
    assert getattr(cfg.zero_optimization, field) == value


def test_stage3_plan_reads_aliases() -> None:
    plan = resolve(
        {
            **BASE,
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": 5e6,
                "stage3_param_persistence_threshold": 1e4,
                "stage3_gather_16bit_weights_on_model_save": True,
                "offload_param": {"device": "cpu"},
            },
        },
        world_size=1,
    )
    s3 = plan.zero.stage3
    assert s3 is not None
    assert (s3.prefetch_numel, s3.persistence_threshold) == (5_000_000, 10_000)
    assert s3.gather_16bit_on_save is True
    assert s3.offload_param == CpuTarget(pin_memory=True)
    assert plan.resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == 5_000_000
    assert not any("stage" in key for key in plan.unimplemented)  # stage 3 is implemented


def test_alias_and_name_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="same setting as 'stage3_prefetch_bucket_size'"):
        resolve(
            {**BASE, "zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}},
            world_size=1,
        )


@pytest.mark.parametrize("value, stage", [(True, 1), (False, 0)])
def test_legacy_zero_optimization_bool(value: bool, stage: int) -> None:
    """DeepSpeed's legacy boolean form is an error naming the modern spelling; a warning with strict false."""
    with pytest.raises(ConfigError, match=rf'zero_optimization: {str(value).lower()} is .* write '
                                          rf'"zero_optimization": {{"stage": {stage}}}'):
        resolve({**BASE, "zero_optimization": value}, world_size=1)
    with pytest.warns(ConfigWarning, match="legacy form"):
        plan = resolve({**BASE, "zero_optimization": value}, world_size=1, strict=False)
    assert plan.zero.stage == stage


def test_bfloat16_is_an_alias_of_bf16() -> None:
    plan = resolve({**BASE, "bfloat16": {"enabled": True}}, world_size=1)
    assert plan.precision.param_dtype == "bf16"
    assert plan.resolved["bf16"]["enabled"] is True


def test_deprecated_cpu_offload_means_offload_optimizer_cpu() -> None:
    with pytest.warns(ConfigWarning, match="cpu_offload is deprecated"):
        plan = resolve({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}}, world_size=1)
    assert isinstance(plan.zero.offload_optimizer, CpuTarget)


def test_deprecated_cpu_offload_with_new_key_is_an_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="either the deprecated 'cpu_offload' or 'offload_optimizer'"):
            resolve(
                {
                    **BASE,
                    "zero_optimization": {
                        "stage": 2,
                        "cpu_offload": True,
                        "offload_optimizer": {"device": "cpu"},
                    },
                },
                world_size=1,
            )


def test_floats_accepted_where_integral() -> None:
    plan = resolve(
        {
            "train_batch_size": 8.0,
            "zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8},
        },
        world_size=1,
    )
    assert plan.zero.reduce_bucket_size == 500_000_000 and isinstance(plan.zero.reduce_bucket_size, int)
    assert plan.resolved["zero_optimization"]["allgather_bucket_size"] == 200_000_000
    assert plan.batch.train_batch_size == 8 and isinstance(plan.batch.train_batch_size, int)


def test_every_field_has_a_docstring() -> None:
    from slipstream.config.schema.base import DSModel

    def walk(model: type[DSModel]) -> list[str]:
        return [f"{model.__name__}.{n}" for n, f in model.model_fields.items() if not f.description]

    from slipstream.config.schema import misc, monitors, optim, precision, top, zero

    models = [
        obj
        for mod in (misc, monitors, optim, precision, top, zero)
        for obj in vars(mod).values()
        if isinstance(obj, type) and issubclass(obj, DSModel) and obj.__module__ == mod.__name__
    ]
    missing = [m for model in models for m in walk(model)]
    assert len(models) > 20
    assert not missing, missing
