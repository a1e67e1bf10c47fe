"""The engine getters Transformers and Accelerate call (compat/engine_getters.py), on a one-process engine: each
answers from the config it was given (Accelerate's get_state_dict asks zero_gather_16bit_weights_on_model_save)."""

from __future__ import annotations

import pytest
import torch

import slipstream
from tests.harness.models import TinyMLP


@pytest.mark.parametrize("stage, gather", [(0, None), (3, False), (3, True)])
def test_gather_16bit_weights_on_model_save(stage: int, gather: bool | None) -> None:
    zero: dict = {"stage": stage}
    if gather is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = gather
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    try:
        assert engine.zero_gather_16bit_weights_on_model_save() is bool(gather)
        assert engine.zero_optimization_stage() == stage
        assert engine.zero_optimization_partition_weights() is (stage == 3)
    finally:
        engine.destroy()


def _config(**extra: object) -> dict:
    return {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}


def test_megatron_attributes(tmp_path) -> None:
    """engine.losses / timers / monitor / mpu / has_moe_layers / num_experts, as Megatron-DeepSpeed reads them."""
    import torch

    from slipstream.compat.monitor_master import MonitorMaster
    from slipstream.compat.timers import NoopTimer, SynchronizedWallClockTimer

    monitor = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=_config(wall_clock_breakdown=True, **monitor))
    try:
        assert engine.losses is None and engine.mpu is None
        assert engine.has_moe_layers is False and engine.num_experts == []
        x = torch.randn(2, 13)
        values = []
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(x).square().mean()
            values.append(float(loss.detach()))
            engine.backward(loss)
        assert engine.losses is not None and abs(float(engine.losses) - sum(values)) < 1e-5
        engine.step()
        assert engine.losses is None  # reset by the step, as DeepSpeed's
        assert isinstance(engine.timers, SynchronizedWallClockTimer) and engine.timers is engine.timers
        assert isinstance(engine.monitor, MonitorMaster) and engine.monitor.enabled
        engine.monitor.write_events([("Train/Samples/custom", 1.5, 7)])
        written = (tmp_path / "job" / "Train_Samples_custom.csv").read_text().splitlines()
        assert written[-1] == "7,1.5"
    finally:
        engine.destroy()
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=_config())
    try:
        assert isinstance(engine.timers, NoopTimer) and not engine.monitor.enabled
    finally:
        engine.destroy()


def test_moe_layers_counted() -> None:
    from tests.dist.moe.moe_models import EXPERTS, TinyMoE

    engine, *_ = slipstream.initialize(model=TinyMoE(), config=_config())
    try:
        assert engine.has_moe_layers is True and engine.num_experts == [EXPERTS]
    finally:
        engine.destroy()


@pytest.mark.parametrize("given", [None, ["torch.nn.modules.linear.Linear"]])
def test_torch_autocast_lower_precision_safe_modules_answers_the_default_list_when_unset(given: list | None) -> None:
    autocast: dict = {"enabled": True, "dtype": "bfloat16"}
    if given is not None:
        autocast["lower_precision_safe_modules"] = given
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=_config(torch_autocast=autocast))
    try:
        deepspeed_default = [f"{c.__module__}.{c.__name__}" for c in (torch.nn.Linear, torch.nn.Conv1d,
                                                                      torch.nn.Conv2d, torch.nn.Conv3d)]
        assert engine.torch_autocast_lower_precision_safe_modules() == (given or deepspeed_default)
    finally:
        engine.destroy()
