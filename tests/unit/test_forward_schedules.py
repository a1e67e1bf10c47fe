"""The legacy seqlen curriculum and progressive layer drop: each schedule against hand-computed values, the
config rules, the engine handing `curriculum_seqlen` / `progressive_layer_drop` / `pld_theta` to the forward in
training only, and a checkpoint round trip that keeps the curriculum where it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config import ConfigError, resolve
from slipstream.config.data_plans import CurriculumPlan
from slipstream.data import CurriculumScheduler

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _curriculum(schedule_type: str, **schedule_config: object) -> dict[str, object]:
    return {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 8,
        "max_difficulty": 64,
        "schedule_type": schedule_type,
        "schedule_config": schedule_config,
    }


def _scheduler(section: dict[str, object]) -> CurriculumScheduler:
    plan = resolve({**BASE, "curriculum_learning": section}, world_size=1).schedules.curriculum
    assert isinstance(plan, CurriculumPlan)
    return CurriculumScheduler(plan)


# By hand, min 8, max 64, step 8: fixed_linear over 10 steps: 8 + 56 * s / 10 floored, then down to a multiple of 8
# (s=1: 13.6 -> 8; s=2: 19.2 -> 16; s=5: 36 -> 32; s=7: 47.2 -> 40; s=10: 64; s=11: 69.6 -> 64 capped).
# fixed_root (degree 2) over 16 steps: 8 + 56 * sqrt(s / 16) (s=1: 22 -> 16; s=4: 36 -> 32; s=9: 50 -> 48).
# fixed_discrete [16, 32, 64] until steps [2, 4]: 16 for steps 1-2, 32 for 3-4, 64 after.
CASES = {
    "fixed_linear": (
        _curriculum("fixed_linear", total_curriculum_step=10, difficulty_step=8),
        {1: 8, 2: 16, 5: 32, 7: 40, 10: 64, 11: 64},
    ),
    "fixed_root": (
        _curriculum("fixed_root", total_curriculum_step=16, difficulty_step=8, root_degree=2),
        {1: 16, 4: 32, 9: 48, 16: 64},
    ),
    "fixed_discrete": (
        _curriculum("fixed_discrete", difficulty=[16, 32, 64], max_step=[2, 4]),
        {1: 16, 2: 16, 3: 32, 4: 32, 5: 64, 9: 64},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_schedule_gives_the_hand_computed_lengths(name: str) -> None:
    section, expected = CASES[name]
    scheduler = _scheduler(section)
    assert {step: scheduler.get_difficulty(step) for step in expected} == expected
    assert scheduler.get_current_difficulty() == 8  # min_difficulty until the first update
    assert [scheduler.update_difficulty(step) for step in sorted(expected)] == [expected[s] for s in sorted(expected)]


def test_a_step_above_min_difficulty_starts_at_its_first_multiple() -> None:
    section = {**_curriculum("fixed_linear", total_curriculum_step=100, difficulty_step=16), "min_difficulty": 8}
    assert _scheduler(section).get_difficulty(1) == 16  # 8.56 floors to 0, raised to the first multiple of 16


def test_config_rules() -> None:
    with pytest.raises(ConfigError, match=r"schedule_config.root_degree is not set"):
        resolve(
            {**BASE, "curriculum_learning": _curriculum("fixed_root", total_curriculum_step=4, difficulty_step=8)},
            world_size=1,
        )
    with pytest.raises(ConfigError, match="one more entry than max_step"):
        resolve(
            {**BASE, "curriculum_learning": _curriculum("fixed_discrete", difficulty=[8, 16], max_step=[2, 4])},
            world_size=1,
        )
    plan = resolve(
        {**BASE, "curriculum_learning": {**CASES["fixed_linear"][0], "curriculum_type": "vocab"}}, world_size=1
    )
    assert plan.schedules.curriculum is None and "curriculum_learning.curriculum_type=vocab" in plan.unimplemented
    plan = resolve(
        {
            **BASE,
            "curriculum_learning": CASES["fixed_linear"][0],
            "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.01},
        },
        world_size=1,
    )
    assert not any(key.startswith(("curriculum", "progressive")) for key in plan.unimplemented)


class Recorder(nn.Module):
    """Records the keyword arguments of each forward; truncates its batch to curriculum_seqlen like Megatron."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.calls: list[dict[str, object]] = []

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.calls.append(kwargs)
        length = kwargs.get("curriculum_seqlen")
        x = x[:, : int(length)] if isinstance(length, int) else x  # type: ignore[call-overload]
        return (x.sum(dim=1, keepdim=True) * self.weight).mean()


def _engine(config: dict[str, object]) -> tuple[slipstream.DeepSpeedEngine, Recorder]:
    model = Recorder()
    engine, *_ = slipstream.initialize(model=model, config={**BASE, **config})
    return engine, model


def _train(engine: slipstream.DeepSpeedEngine, steps: int) -> None:
    for _ in range(steps):
        engine.backward(engine(torch.ones(2, 64)))
        engine.step()


def test_the_engine_hands_the_kwargs_in_training_only() -> None:
    pld = {"enabled": True, "theta": 0.4, "gamma": 0.1}
    engine, model = _engine({"curriculum_learning": CASES["fixed_linear"][0], "progressive_layer_drop": pld})
    _train(engine, 4)
    # step g sees theta(g - 1), 1.0 first; theta(t) = 0.6 * exp(-0.1 t) + 0.4: 1.0, 0.9429025, 0.8912385, 0.8444909
    expected_theta = [1.0, 1.0, 0.942902451, 0.891238452]
    assert [call["curriculum_seqlen"] for call in model.calls] == [8, 16, 24, 24]  # s=3: 24.8 -> 24; s=4: 30.4 -> 24
    assert [call["progressive_layer_drop"] for call in model.calls] == [True] * 4
    assert [call["pld_theta"] for call in model.calls] == pytest.approx(expected_theta, abs=1e-9)
    assert engine.get_pld_theta() == pytest.approx(0.844490933, abs=1e-9)
    engine.eval()
    engine(torch.ones(2, 64))
    assert model.calls[-1] == {}
    plain, plain_model = _engine({})
    _train(plain, 1)
    assert plain_model.calls == [{}] and plain.get_pld_theta() is None


def test_a_checkpoint_keeps_the_schedule(tmp_path: Path) -> None:
    section = _curriculum("fixed_discrete", difficulty=[16, 64, 32], max_step=[2, 3])
    engine, model = _engine({"curriculum_learning": section})
    _train(engine, 3)  # steps 1, 2, 3: 16, 16, 64 (the maximum: the difficulty stays there from now on)
    engine.save_checkpoint(str(tmp_path))
    _train(engine, 2)
    resumed, resumed_model = _engine({"curriculum_learning": section})
    resumed.load_checkpoint(str(tmp_path))
    _train(resumed, 2)
    assert [c["curriculum_seqlen"] for c in model.calls] == [16, 16, 64, 64, 64]  # the schedule alone says 32
    assert [c["curriculum_seqlen"] for c in resumed_model.calls] == [64, 64]  # a fresh scheduler: [32, 32]


def test_a_custom_schedule_follows_the_function_and_resumes(tmp_path: Path) -> None:
    section = {key: value for key, value in _curriculum("custom").items() if key != "schedule_config"}
    plan = resolve({**BASE, "curriculum_learning": section}, world_size=1)
    assert plan.schedules.curriculum is not None and not any(k.startswith("curr") for k in plan.unimplemented)
    engine, model = _engine({"curriculum_learning": section})
    with pytest.raises(RuntimeError, match=r"curriculum_scheduler_legacy\.set_custom_get_difficulty"):
        engine(torch.ones(2, 64))
    lengths = {1: 8, 2: 24, 3: 16, 4: 64, 5: 8, 6: 40}  # the function's value per step; max_difficulty is 64
    engine.curriculum_scheduler_legacy.set_custom_get_difficulty(lengths.__getitem__)
    _train(engine, 4)
    engine.save_checkpoint(str(tmp_path))
    _train(engine, 2)
    # by hand: the step's own value until the length reaches 64 (step 4), then 64 whatever the function says
    assert [c["curriculum_seqlen"] for c in model.calls] == [8, 24, 16, 64, 64, 64]
    resumed, resumed_model = _engine({"curriculum_learning": section})
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.curriculum_scheduler_legacy.get_current_difficulty() == 64  # a fresh schedule starts at 8
    resumed.curriculum_scheduler_legacy.set_custom_get_difficulty(lengths.__getitem__)
    _train(resumed, 2)
    assert [c["curriculum_seqlen"] for c in resumed_model.calls] == [64, 64]  # a fresh one: [8, 40]
