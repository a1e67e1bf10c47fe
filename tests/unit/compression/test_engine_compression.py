"""The engine drives compression by itself, as DeepSpeed's does: with a `compression_training` section and a
model that went through init_compression, pruning switches on in the forward after the optimizer step that
reaches schedule_offset (an offset of 0: from the first forward), and an optimizer step skipped for an fp16
overflow does not count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slipstream
from slipstream.compression import CompressedLinear, init_compression


def _config(offset: int, fp16: bool) -> dict[str, object]:
    row = {
        "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": offset},
        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}},
    }
    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "compression_training": {"row_pruning": row},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    return config


def _pruned_rows_seen(offset: int, *, fp16: bool, overflow_at: int | None, steps: int) -> list[int]:
    """Per forward (1-based), how many of fc1's outputs were exactly zero for every sample (pruned rows)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 6))
    model.add_module("act", nn.ReLU())
    model.add_module("fc2", nn.Linear(6, 2))
    config = _config(offset, fp16)
    model = init_compression(model, config)
    engine, *_ = slipstream.initialize(model=model, config=config)
    assert isinstance(engine.module.fc1, CompressedLinear) and engine.compression_scheduler is not None
    seen: list[int] = []
    engine.module.fc1.register_forward_hook(lambda m, i, out: seen.append(int((out == 0).all(dim=0).sum())))
    for step in range(1, steps + 1):
        x = torch.randn(2, 4) + 3.0  # away from zero: an unpruned output is never exactly 0
        if step == overflow_at:
            x[0, 0] = float("inf")
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        assert engine.was_step_applied() is (step != overflow_at)
        applied = step - (overflow_at is not None and step >= overflow_at)
        assert engine.compression_scheduler.training_steps == applied  # stepped right after the optimizer
    return seen


@pytest.mark.parametrize(
    "offset,fp16,overflow_at,expected",
    [
        (3, False, None, [0, 0, 0, 3, 3]),  # three applied steps reach the offset: on from the 4th forward
        (3, True, 2, [0, 0, 0, 0, 3]),  # the 2nd step overflows and is skipped: on one forward later
        (0, False, None, [3, 3]),  # offset 0: on before the first forward (DeepSpeed's step-zero check)
    ],
)
def test_engine_turns_row_pruning_on_at_the_offset(
    offset: int, fp16: bool, overflow_at: int | None, expected: list[int]
) -> None:
    assert _pruned_rows_seen(offset, fp16=fp16, overflow_at=overflow_at, steps=len(expected)) == expected


def test_without_init_compression_the_engine_has_no_scheduler() -> None:
    engine, *_ = slipstream.initialize(model=nn.Linear(4, 2), config=_config(0, fp16=False))
    assert engine.compression_scheduler is None


def _two_method_config(offset: int) -> dict[str, object]:
    config = _config(offset, fp16=False)
    config["compression_training"]["weight_quantization"] = {  # type: ignore[index]
        "shared_parameters": {"enabled": True, "schedule_offset": 0},
        "different_groups": {
            "wq": {"params": {"start_bits": 8, "target_bits": 5, "quantization_period": 1}, "modules": ["fc2"]}
        },
    }
    return config


def _engine(seed: int, config: dict[str, object]) -> slipstream.DeepSpeedEngine:
    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 6))
    model.add_module("act", nn.ReLU())
    model.add_module("fc2", nn.Linear(6, 2))
    engine, *_ = slipstream.initialize(model=init_compression(model, config), config=config)
    return engine


def _train(engine: slipstream.DeepSpeedEngine, steps: int, seen: list[tuple[bool, int]]) -> None:
    for _ in range(steps):
        module = engine.module
        loss = engine(torch.randn(2, 4) + 3.0).pow(2).mean()
        seen.append((module.fc1.row_pruning.enabled, module.fc2.schedule.bits))
        engine.backward(loss)
        engine.step()


def test_a_resumed_run_continues_the_schedules_where_the_checkpoint_left_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = _two_method_config(offset=3)
    straight: list[tuple[bool, int]] = []
    _train(_engine(0, config), 5, straight)
    # row pruning on after 3 applied steps; 8 bits, one less after 1, 2 and 4 steps (the period doubles)
    assert straight == [(False, 8), (False, 7), (False, 6), (True, 6), (True, 5)]
    first: list[tuple[bool, int]] = []
    engine = _engine(0, config)
    _train(engine, 2, first)
    engine.save_checkpoint(str(tmp_path))
    resumed = _engine(1, config)  # another initialisation: the l1 mask comes from the checkpoint
    resumed.load_checkpoint(str(tmp_path))
    assert torch.equal(resumed.module.fc1.row_pruning.fixed, engine.module.fc1.row_pruning.fixed)
    _train(resumed, 3, first)
    assert first == straight
