"""DeepSpeed's `CurriculumScheduler` at its import path: the difficulties of each schedule against hand-computed
values (the ones DeepSpeed's own engine tests expect), its state methods, the custom schedule, and errors that
name the key."""

from __future__ import annotations

import pytest

import slipstream  # noqa: F401  (DeepSpeed's module paths)
from slipstream.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler


def _linear() -> CurriculumScheduler:
    return CurriculumScheduler(
        {
            "min_difficulty": 2,
            "max_difficulty": 10,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2},
        }
    )


def test_schedules_by_hand() -> None:
    # fixed_linear: floor(2 + 8 * s / 8) rounded down to a multiple of 2, at most 10
    assert [_linear().get_difficulty(s) for s in range(1, 11)] == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]
    discrete = CurriculumScheduler(
        {
            "min_difficulty": 1,
            "max_difficulty": 5,
            "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [1, 2, 3, 4, 5], "max_step": [2, 4, 6, 8]},
        }
    )
    assert [discrete.get_difficulty(s) for s in range(1, 11)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    root = CurriculumScheduler(
        {
            "min_difficulty": 8,
            "max_difficulty": 64,
            "schedule_type": "fixed_root",
            "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8, "root_degree": 2},
        }
    )
    # s = 25: sqrt(0.25) * 56 + 8 = 36 -> 32; s = 64: 0.8 * 56 + 8 = 52.8 -> 48
    assert [root.get_difficulty(s) for s in (25, 64, 100, 200)] == [32, 48, 64, 64]


def test_state_methods_and_update() -> None:
    scheduler = _linear()
    assert scheduler.get_current_difficulty() == 2
    assert [scheduler.update_difficulty(s) for s in (1, 2, 8)] == [2, 4, 10]
    assert scheduler.update_difficulty(1) == 10  # it stops moving at the maximum, as DeepSpeed's does
    state = scheduler.get_state()
    assert state["current_difficulty"] == 10 and state["schedule_type"] == "fixed_linear"
    fresh = _linear()
    fresh.set_state(dict(state, current_difficulty=6))
    assert fresh.get_current_difficulty() == 6
    fresh.set_current_difficulty(4)
    assert fresh.update_difficulty(5) == 6


def test_custom_schedule_asks_the_function() -> None:
    custom = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 100, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        custom.get_difficulty(3)
    custom.set_custom_get_difficulty(lambda step: 3 * step)
    assert [custom.update_difficulty(s) for s in (1, 5)] == [3, 15]


def test_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="max_difficulty"):
        CurriculumScheduler({"min_difficulty": 1, "schedule_type": "fixed_linear"})
    with pytest.raises(ValueError, match="'steps' is not one of"):
        CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "steps"})
    with pytest.raises(ValueError, match="total_curriculum_step"):
        CurriculumScheduler(
            {
                "min_difficulty": 1,
                "max_difficulty": 4,
                "schedule_type": "fixed_linear",
                "schedule_config": {"difficulty_step": 1},
            }
        )
