"""fp16 loss scaling: scale sequences for given overflow patterns, worked out by hand from DeepSpeed's rule."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.config.plan import LossScalePlan
from slipstream.zero.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    StaticLossScaler,
    has_overflow,
    make_loss_scaler,
)


def _plan(power: int = 4, window: int = 2, hysteresis: int = 1, consecutive: bool = False,
          min_scale: float = 1.0, static: float | None = None) -> LossScalePlan:
    return LossScalePlan(static_scale=static, initial_scale_power=power, window=window, hysteresis=hysteresis,
                         consecutive_hysteresis=consecutive, min_scale=min_scale)


def _scales(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_grows_after_window_clean_steps_and_halves_on_overflow() -> None:
    scaler = DynamicLossScaler(_plan(power=4, window=2))
    assert scaler.scale == 16.0  # 2 ** 4
    # clean steps before this one since the last overflow: 0, 1, 2 (x2), 3, overflow, 0, 1, 2 (x2)
    assert _scales(scaler, [False, False, False, False, True, False, False, False]) == \
        [16, 16, 32, 32, 16, 16, 16, 32]


def test_hysteresis_delays_the_cut_and_refills_only_on_growth() -> None:
    scaler = DynamicLossScaler(_plan(power=4, window=2, hysteresis=2))
    # overflow spends the budget (2 -> 1); a clean step does not refill it; the next overflows halve
    assert _scales(scaler, [True, False, True, True]) == [16, 16, 8, 4]
    assert scaler.cur_hysteresis == 1

    scaler = DynamicLossScaler(_plan(power=4, window=2, hysteresis=2))
    # budget 2 -> 1; third clean step doubles the scale and refills the budget to 2; then 2 -> 1, then halve
    assert _scales(scaler, [True, False, False, False, True, True]) == [16, 16, 16, 32, 32, 16]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    scaler = DynamicLossScaler(_plan(power=4, window=100, hysteresis=2, consecutive=True))
    # budget 2 -> 1, refilled to 2 by the clean step, 2 -> 1 again, then the cut
    assert _scales(scaler, [True, False, True, True]) == [16, 16, 16, 8]


def test_floor_at_min_scale_and_stuck_after_window_overflows_there() -> None:
    scaler = DynamicLossScaler(_plan(power=2, window=3, min_scale=1.0))
    assert _scales(scaler, [True, True]) == [2, 1]  # 4 -> 2 -> 1
    assert scaler.num_overflows_at_min == 0 and not scaler.stuck()
    assert _scales(scaler, [True, True]) == [1, 1]  # already at the floor: counted
    assert scaler.num_overflows_at_min == 2 and not scaler.stuck()
    scaler.update(False)  # one clean step resets the streak
    assert scaler.num_overflows_at_min == 0
    _scales(scaler, [True, True, True])
    assert scaler.at_minimum_for(3) and scaler.stuck()


def test_min_scale_need_not_be_a_power_of_two() -> None:
    scaler = DynamicLossScaler(_plan(power=3, window=5, min_scale=3.0))
    assert _scales(scaler, [True, True, True]) == [4, 3, 3]  # max(8 / 2, 3), max(4 / 2, 3)


def test_take_report_aggregates_overflows() -> None:
    scaler = DynamicLossScaler(_plan(power=12, window=1000))
    assert scaler.take_report() is None
    _scales(scaler, [True, False, True, False, True])  # 4096 -> 2048 -> 1024 -> 512
    assert scaler.overflow_count_since_report == 3
    assert scaler.take_report() == "fp16: 3 overflow steps skipped since step 0; loss scale now 512"
    assert scaler.overflow_count_since_report == 0
    _scales(scaler, [False, False])
    assert scaler.take_report() is None
    scaler.update(True)
    assert scaler.take_report() == "fp16: 1 overflow step skipped since step 7; loss scale now 256"


def test_fractional_scale_in_report() -> None:
    scaler = DynamicLossScaler(_plan(power=0, window=10, min_scale=0.25))
    _scales(scaler, [True])
    assert scaler.take_report() == "fp16: 1 overflow step skipped since step 0; loss scale now 0.5"


def test_state_dict_round_trip_continues_identically() -> None:
    pattern = [True, False, False, False, True, False, True, False, False, False, False]
    original = DynamicLossScaler(_plan(power=8, window=3, hysteresis=2))
    _scales(original, pattern[:5])
    restored = DynamicLossScaler(_plan(power=8, window=3, hysteresis=2))
    restored.load_state_dict(original.state_dict())
    assert restored.state_dict() == original.state_dict()
    assert _scales(restored, pattern[5:]) == _scales(original, pattern[5:])
    assert restored.take_report() == original.take_report()
    as_tensors = DynamicLossScaler(_plan(power=8, window=3, hysteresis=2))  # a checkpoint may hold 0-d tensors
    as_tensors.load_state_dict({key: torch.tensor(value) for key, value in original.state_dict().items()})
    loaded = as_tensors.state_dict()
    assert loaded == original.state_dict() and [type(v) for v in loaded.values()] == [float] + [int] * 7, loaded


def test_scale_loss_multiplies() -> None:
    scaler = DynamicLossScaler(_plan(power=3))
    assert float(scaler.scale_loss(torch.tensor(0.5))) == 0.5 * 8


def test_static_scaler_keeps_scale_and_reports() -> None:
    scaler = StaticLossScaler(128.0)
    for overflow in [True, False, True]:
        scaler.update(overflow)
    assert scaler.scale == 128.0 and not scaler.stuck()
    assert float(scaler.scale_loss(torch.tensor(2.0))) == 256.0
    state = scaler.state_dict()
    assert scaler.take_report() == "fp16: 2 overflow steps skipped since step 0; loss scale now 128"
    again = StaticLossScaler(1.0)
    again.load_state_dict(state)
    assert again.scale == 128.0 and again.overflow_count_since_report == 2


def test_make_loss_scaler_picks_the_kind() -> None:
    assert make_loss_scaler(None) is None
    static = make_loss_scaler(_plan(static=64.0))
    assert isinstance(static, StaticLossScaler) and static.scale == 64.0
    dynamic = make_loss_scaler(_plan(power=16))
    assert isinstance(dynamic, DynamicLossScaler) and dynamic.scale == 65536.0
    assert isinstance(static, LossScaler) and isinstance(dynamic, LossScaler)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"window": 0}, "fp16.loss_scale_window=0"),
    ({"hysteresis": 0}, "fp16.hysteresis=0"),
    ({"min_scale": 0.0}, "fp16.min_loss_scale=0.0"),
])
def test_invalid_plans_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        DynamicLossScaler(_plan(**kwargs))


def test_invalid_static_scale() -> None:
    with pytest.raises(ValueError, match="fp16.loss_scale=-1.0"):
        StaticLossScaler(-1.0)
    with pytest.raises(ValueError, match="make_loss_scaler"):
        DynamicLossScaler(_plan(static=8.0))


def test_has_overflow() -> None:
    finite = [torch.ones(3), torch.zeros(2, 2, dtype=torch.float16), None]
    assert not has_overflow(finite)
    assert not has_overflow([])
    assert has_overflow([*finite, torch.tensor([1.0, math.inf])])
    assert has_overflow([torch.tensor([-math.inf]), torch.ones(1)])
    assert has_overflow([torch.ones(1), torch.tensor([math.nan], dtype=torch.bfloat16)])
