"""Cross-field rules of resolve(): precision, ZeRO, optimizer/scheduler names, unimplemented keys,
`resolved`."""

from __future__ import annotations

import json
import warnings

import pytest

from slipstream.config import ConfigError, ConfigWarning, CpuTarget, EnginePlan, NoOffloadTarget, NvmeTarget, resolve

BASE = {"train_batch_size": 8}


def plan_of(extra: dict, **kwargs: object) -> EnginePlan:
    return resolve({**BASE, **extra}, world_size=1, **kwargs)  # type: ignore[arg-type]


def test_fp16_and_bf16_both_enabled_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        plan_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert info.value.problems == ["fp16.enabled, bf16.enabled: both are true; enable at most one of fp16 and bf16"]


def test_bf16_plan() -> None:
    precision = plan_of({"bf16": {"enabled": True}}).precision
    assert (precision.param_dtype, precision.master_dtype, precision.grad_accum_dtype) == (
        "bf16",
        "fp32",
        "fp32",
    )
    assert precision.loss_scale is None and precision.check_grad_overflow is True


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16"])
def test_grad_accum_dtype_override(spelling: str) -> None:
    precision = plan_of({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": spelling}}).precision
    assert precision.grad_accum_dtype == "bf16"


def test_unknown_grad_accum_dtype() -> None:
    with pytest.raises(ConfigError, match="data_types.grad_accum_dtype: unknown dtype 'fp8'"):
        plan_of({"data_types": {"grad_accum_dtype": "fp8"}})


def test_fp16_dynamic_loss_scale_plan() -> None:
    precision = plan_of({"fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3}}).precision
    assert (precision.param_dtype, precision.master_dtype, precision.grad_accum_dtype) == (
        "fp16",
        "fp32",
        "fp32",
    )
    scale = precision.loss_scale
    assert scale is not None and scale.static_scale is None
    assert (scale.initial_scale_power, scale.window, scale.hysteresis, scale.min_scale) == (12, 1000, 3, 1.0)
    assert scale.consecutive_hysteresis is False


def test_fp16_static_loss_scale_plan() -> None:
    scale = plan_of({"fp16": {"enabled": True, "loss_scale": 128}}).precision.loss_scale
    assert scale is not None and scale.static_scale == 128.0


def test_fp32_is_the_default() -> None:
    precision = plan_of({}).precision
    assert (precision.param_dtype, precision.grad_accum_dtype, precision.master_dtype) == ("fp32",) * 3


@pytest.mark.parametrize(
    "type_, params, name",
    [
        ("Adam", {}, "adamw"),
        ("adam", {"adam_w_mode": False}, "adam"),
        ("Adam", {"adam_w_mode": True, "torch_adam": True}, "adamw"),
        ("AdamW", {"adam_w_mode": False}, "adamw"),
        ("Lamb", {}, "lamb"),
        ("Lion", {}, "lion"),
        ("Adagrad", {}, "adagrad"),
        ("SGD", {}, "sgd"),
        ("RMSprop", {}, "RMSprop"),
    ],
)
def test_optimizer_canonical_names(type_: str, params: dict, name: str) -> None:
    optimizer = plan_of({"optimizer": {"type": type_, "params": {"lr": 0.1, **params}}}).optimizer
    assert optimizer is not None and optimizer.name == name
    # DeepSpeed's Adam family defaults weight_decay to 0 (torch's AdamW: 0.01), unless torch_adam asks for torch's
    adam_family = name in ("adam", "adamw") and not params.get("torch_adam")
    torch_adam = {"torch_adam": True} if params.get("torch_adam") else {}  # the engine builds torch's class
    assert optimizer.params == ({"lr": 0.1, "weight_decay": 0.0} if adam_family else {"lr": 0.1, **torch_adam})


def test_max_grad_norm_points_to_gradient_clipping() -> None:
    with pytest.raises(ConfigError) as info:
        plan_of({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 0.5}}})
    assert info.value.problems == [
        'optimizer.params.max_grad_norm: not supported; use the top-level "gradient_clipping": 0.5 instead'
    ]


def test_unknown_optimizer_and_scheduler() -> None:
    with pytest.raises(ConfigError) as info:
        plan_of({"optimizer": {"type": "Adamm"}, "scheduler": {"type": "warmuplr"}})
    assert info.value.problems[0].startswith("optimizer.type: unknown optimizer 'Adamm'; did you mean 'adam'?")
    assert info.value.problems[1].startswith("scheduler.type: unknown scheduler 'warmuplr'; did you mean 'WarmupLR'?")


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "StepLR"])
def test_scheduler_names(name: str) -> None:
    scheduler = plan_of({"scheduler": {"type": name, "params": {"x": 1}}}).scheduler
    assert scheduler is not None and (scheduler.name, scheduler.params) == (name, {"x": 1})


def test_zero_plan_from_stage_2_config() -> None:
    plan = plan_of(
        {
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 2e8,
                "allgather_bucket_size": 3e8,
                "contiguous_gradients": False,
                "reduce_scatter": False,
                "offload_optimizer": {"device": "cpu", "pin_memory": False},
            }
        }
    )
    zero = plan.zero
    assert (zero.stage, zero.reduce_bucket_size, zero.stage3) == (2, 200_000_000, None)
    assert zero.offload_optimizer == CpuTarget(pin_memory=False)
    # knobs whose behaviour is fixed here are reported when set away from DeepSpeed's default, never dropped
    assert set(plan.unimplemented) == {
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter",
    }


def test_offload_device_none_is_no_offload() -> None:
    target = plan_of(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    ).zero.offload_optimizer
    assert target == NoOffloadTarget() and not target.on_host


def test_offload_at_stage_0_warns() -> None:
    with pytest.warns(ConfigWarning, match="offload_optimizer has no effect at stage 0"):
        plan_of({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})


def test_nvme_offload_needs_a_path() -> None:
    with pytest.raises(ConfigError, match="offload_optimizer.nvme_path: required"):
        plan_of({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    plan = plan_of({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nv"}}})
    target = plan.zero.offload_optimizer
    assert isinstance(target, NvmeTarget) and target.path == "/nv" and target.on_host
    assert not plan.unimplemented


def test_unimplemented_lists_what_the_user_set() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_of(
            {
                "zero_optimization": {
                    "stage": 3,
                    "round_robin_gradients": True,
                },
                "flops_profiler": {"enabled": True},
                "wandb": {"enabled": False, "project": "p"},
                "activation_checkpointing": {"contiguous_memory_optimization": True, "number_checkpoints": 2},
                "hybrid_engine": {"enabled": True, "release_inference_cache": True},
                "sparse_attention": {"mode": "fixed"},
                "memory_breakdown": True,
                "dump_state": False,
                "bf16": {"enabled": True, "immediate_grad_update": True},
                "data_types": {"buffer_dtype": "bf16"},
                "optimizer": {"type": "MuAdam"},
                "csv_monitor": {"enabled": True, "output_path": "/tmp/csv"},
                "comet": {"enabled": True},
            }
        )
    assert set(plan.unimplemented) == {
        "zero_optimization.round_robin_gradients",
        "memory_breakdown",
        "optimizer.type=muadam",
    }
    assert plan.logging.monitor.csv_output_path == "/tmp/csv"
    assert plan.logging.flops_profile is not None and plan.logging.monitor.comet is not None


def test_implemented_keys_are_not_listed() -> None:
    plan = plan_of(
        {
            "steps_per_print": 10,
            "wall_clock_breakdown": True,
            "gradient_clipping": 0.0,
            "dataloader_drop_last": True,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 1e6},
            "fp16": {"enabled": True, "loss_scale_window": 500},
            "tensorboard": {"enabled": True},
            "optimizer": {"type": "adamw", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupLR"},
        }
    )
    assert plan.unimplemented == ()
    assert plan.gradient_clipping == 0.0 and plan.dataloader_drop_last is True
    assert plan.zero.allow_untested_optimizer is True and plan.zero.force_host_optimizer is False
    assert plan.logging.steps_per_print == 10 and plan.logging.wall_clock_breakdown is True
    assert plan.logging.monitor.tensorboard_output_path == ""
    assert plan.logging.monitor.tensorboard_job_name == "DeepSpeedJobName"


@pytest.mark.parametrize(
    "section",
    [
        {"amp": {"enabled": True, "opt_level": "O1"}},
        {"pipeline": {"partition": "uniform"}},
        {"elasticity": {"enabled": False, "min_time": 20}},
        {"autotuning": {"enabled": True, "tuner_type": "model_based", "model_info": {"profile": True}}},
        {"quantize_training": {"enabled": True}},
        {"data_efficiency": {"data_sampling": {"pin_memory": True}}},
        {"tensor_parallel": {"tp_overlap_comm": True}},
        {"aio": {"use_gds": True}},
        {"checkpoint": {"use_node_local_storage": True}},
        {"compile": {"deepcompile": True}},
        {"nebula": {"enabled": True}},
    ],
)
def test_unimplemented_sections_are_accepted_and_listed(section: dict) -> None:
    # (aio.queue_depth and checkpoint.tag_validation are implemented; their other keys are not)
    plan = plan_of(section)
    assert plan.unimplemented, section
    assert all(key.split(".")[0].split("=")[0] in section for key in plan.unimplemented)


def test_resolved_is_plain_json_with_defaults() -> None:
    plan = plan_of({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    resolved = plan.resolved
    assert json.loads(json.dumps(resolved)) == resolved
    assert resolved["gradient_clipping"] == 1.0 and resolved["strict"] is True
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert resolved["zero_optimization"]["stage3_max_live_parameters"] == 1_000_000_000
    assert resolved["fp16"]["initial_scale_power"] == 16
    assert resolved["bf16"]["enabled"] is True and "bfloat16" not in resolved


def test_fixed_schedule_keys_are_reported_when_set() -> None:
    """Keys whose behaviour Slipstream fixes (the reduction schedule is the stage's own) warn when set away from
    DeepSpeed's default instead of being dropped; gradient predivision is honoured at every stage."""
    plan = plan_of(
        {
            "prescale_gradients": True,
            "gradient_predivide_factor": 2.0,
            "zero_optimization": {"stage": 3, "overlap_comm": True, "allgather_bucket_size": 2e8},
        }
    )
    assert set(plan.unimplemented) == {"zero_optimization.allgather_bucket_size"}
    assert plan_of({"prescale_gradients": False, "gradient_predivide_factor": 1.0}).unimplemented == ()


def test_nvme_gradients_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.config.plan import nvme_gradients_in_files

    monkeypatch.delenv("SLIPSTREAM_NVME_GRADIENTS", raising=False)
    assert nvme_gradients_in_files()
    monkeypatch.setenv("SLIPSTREAM_NVME_GRADIENTS", "Memory")
    assert not nvme_gradients_in_files()
    monkeypatch.setenv("SLIPSTREAM_NVME_GRADIENTS", "disk")
    with pytest.raises(ValueError, match="SLIPSTREAM_NVME_GRADIENTS='disk'.*'files'.*'memory'"):
        nvme_gradients_in_files()
