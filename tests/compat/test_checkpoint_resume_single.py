"""A checkpoint resumes training exactly, in one process: the fp16 dynamic loss scaler's state (scale, hysteresis
budget, iteration counters) and the whole optimizer state (masters, Adam moments, step counts, param groups)
come back as saved, and the step after a reload is bit-identical to the step of the run that never stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import slipstream
from tests.harness.models import TinyMLP

BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
}
# A scale that only overflows move: 2**8 at the start, halved at the third overflow (hysteresis 3), never doubled
# back within the test (window 1000).
FP16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 3, "loss_scale_window": 1000}


def _engine(stage: int, **extra: Any) -> slipstream.SlipstreamEngine:
    config = {**BASE, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    return engine


def _step(engine: slipstream.SlipstreamEngine, seed: int, *, overflow: bool = False) -> None:
    x, y = TinyMLP().make_batch(seed=seed, batch_size=4)
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        x = x.to(torch.float16 if engine.fp16_enabled() else torch.bfloat16)
    if overflow:
        x = x.clone()
        x[0, 0] = float("inf")
    engine.backward(TinyMLP.loss(engine(x), y))
    engine.step()


def optimizer_snapshot(engine: slipstream.SlipstreamEngine) -> dict[str, Any]:
    """Every owned piece's master and optimizer state (tensors cloned, scalars as floats) and the param groups'
    hyperparameters, keyed so that two engines of the same plan compare with `==` per entry."""
    optimizer = engine.optimizer
    pieces: dict[tuple[str, int, int], dict[str, Any]] = {}
    for piece in optimizer.owned_slices(engine._param_names, for_save=False):
        state = optimizer.optimizer.state[piece.piece]
        entry: dict[str, Any] = {"master": piece.master.detach().clone()}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = piece.state_view(state, key).detach().clone()
            else:
                entry[key] = float(value)
        pieces[(piece.name, piece.lo, piece.hi)] = entry
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.optimizer.param_groups]
    return {"pieces": pieces, "groups": groups}


def assert_same_optimizer_state(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert got["groups"] == want["groups"], f"{where}: param groups {got['groups']} != {want['groups']}"
    assert got["pieces"].keys() == want["pieces"].keys(), where
    for key, expected in want["pieces"].items():
        actual = got["pieces"][key]
        assert actual.keys() == expected.keys(), f"{where} {key}: state keys {sorted(actual)} != {sorted(expected)}"
        for name, value in expected.items():
            same = torch.equal(actual[name], value) if isinstance(value, torch.Tensor) else actual[name] == value
            assert same, f"{where} {key} {name}: {actual[name]} != {value}"


def test_fp16_dynamic_loss_scale_survives_a_checkpoint(tmp_path: Path) -> None:
    engine = _engine(2, fp16=FP16)
    _step(engine, 0)
    for seed in (1, 2, 3):  # hysteresis 3 -> 2 -> 1, then the scale halves
        _step(engine, seed, overflow=True)
    _step(engine, 4)
    saved = engine.loss_scaler.state_dict()
    assert saved["scale"] == 128.0 and saved["cur_hysteresis"] == 1 and saved["cur_iter"] == 5, saved
    assert engine.skipped_steps == 3
    engine.save_checkpoint(str(tmp_path), tag="t")

    resumed = _engine(2, fp16=FP16)
    assert resumed.loss_scaler.state_dict() != saved  # a fresh scaler starts elsewhere: the load must restore it
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert resumed.loss_scaler.state_dict() == saved
    assert resumed.skipped_steps == 3
    # The restored hysteresis budget is spent: the next overflow halves the scale at once in both runs.
    for run in (engine, resumed):
        _step(run, 5, overflow=True)
        _step(run, 6)
    assert resumed.loss_scaler.state_dict() == engine.loss_scaler.state_dict()
    assert resumed.loss_scaler.scale == 64.0
    assert_same_optimizer_state(optimizer_snapshot(resumed), optimizer_snapshot(engine), "fp16 after resume")


@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_optimizer_state_survives_a_checkpoint_and_the_next_step_is_bit_identical(
    tmp_path: Path, stage: int, precision: str
) -> None:
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine = _engine(stage, **extra)
    for seed in range(3):
        _step(engine, seed)
    before = optimizer_snapshot(engine)
    assert before["groups"][0]["lr"] not in (0.0, 1e-2)  # the warm-up schedule moved it
    engine.save_checkpoint(str(tmp_path), tag="t")

    resumed = _engine(stage, **extra)
    _step(resumed, 99)  # state of its own (moments, step count, lr) that the load must replace
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert_same_optimizer_state(optimizer_snapshot(resumed), before, "after the load")

    for run in (engine, resumed):
        _step(run, 3)
    assert_same_optimizer_state(optimizer_snapshot(resumed), optimizer_snapshot(engine), "the step after the load")
    with slipstream.zero.GatheredParameters(list(engine.module.parameters()) + list(resumed.module.parameters())):
        for (name, want), (_, got) in zip(engine.module.named_parameters(), resumed.module.named_parameters()):
            assert torch.equal(got, want), f"parameter {name} after the step that followed the load"
