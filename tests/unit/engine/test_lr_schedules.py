"""DeepSpeed LR schedules: each formula pinned at several iterations against arithmetic written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.engine.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _sgd(lr: float = 0.1, groups: int = 1) -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)], lr=lr)


def _adam(lr: float = 0.1) -> torch.optim.Adam:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lr_at(schedule, it: int) -> float:
    schedule.step(it)
    return schedule.optimizer.param_groups[0]["lr"]


def test_warmup_log_pinned() -> None:
    sched = WarmupLR(_sgd(), warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="log")
    assert sched.optimizer.param_groups[0]["lr"] == 0.0  # construction writes the min lr
    assert sched.get_last_lr() == [0.0]
    sched.step()  # iteration 0: log(1) = 0
    assert sched.last_batch_iteration == 0
    assert sched.get_last_lr()[0] == pytest.approx(0.0 + (0.01 - 0.0) * math.log(0 + 1) / math.log(10))
    sched.step()  # iteration 1
    assert sched.get_last_lr()[0] == pytest.approx(0.0 + (0.01 - 0.0) * math.log(1 + 1) / math.log(10))
    assert _lr_at(sched, 3) == pytest.approx(0.0 + (0.01 - 0.0) * math.log(3 + 1) / math.log(10))
    assert _lr_at(sched, 9) == pytest.approx(0.01)  # log(10) / log(10)
    assert _lr_at(sched, 10) == pytest.approx(0.01)
    assert _lr_at(sched, 500) == pytest.approx(0.01)


def test_warmup_linear_and_groups() -> None:
    sched = WarmupLR(
        _sgd(groups=2),
        warmup_min_lr=[0.001, 0.0],
        warmup_max_lr=[0.011, 0.02],
        warmup_num_steps=10,
        warmup_type="linear",
    )
    assert [g["lr"] for g in sched.optimizer.param_groups] == [0.001, 0.0]
    sched.step(4)
    assert sched.get_last_lr() == pytest.approx([0.001 + (0.011 - 0.001) * 4 / 10, 0.0 + (0.02 - 0.0) * 4 / 10])
    sched.step(10)
    assert sched.get_last_lr() == pytest.approx([0.011, 0.02])


def test_warmup_steps_clamped_to_two_and_max_defaults_to_group_lr() -> None:
    sched = WarmupLR(_sgd(lr=0.3), warmup_num_steps=1)
    assert sched.warmup_num_steps == 2
    assert _lr_at(sched, 0) == pytest.approx(0.0)
    assert _lr_at(sched, 1) == pytest.approx(0.3 * math.log(1 + 1) / math.log(2))  # = 0.3


def test_warmup_decay_pinned() -> None:
    sched = WarmupDecayLR(
        _sgd(), total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear"
    )
    assert _lr_at(sched, 0) == pytest.approx(0.0)
    assert _lr_at(sched, 9) == pytest.approx(0.01 * 9 / 10)
    assert _lr_at(sched, 10) == pytest.approx(0.01 * (20 - 10) / (20 - 10))
    assert _lr_at(sched, 15) == pytest.approx(0.01 * (20 - 15) / (20 - 10))
    assert _lr_at(sched, 20) == pytest.approx(0.0)
    assert _lr_at(sched, 25) == 0.0  # max(0, negative)


def test_warmup_decay_log_mid_warmup() -> None:
    sched = WarmupDecayLR(_sgd(), total_num_steps=100, warmup_min_lr=0.001, warmup_max_lr=0.005, warmup_num_steps=8)
    assert _lr_at(sched, 5) == pytest.approx(0.001 + (0.005 - 0.001) * math.log(5 + 1) / math.log(8))
    assert _lr_at(sched, 54) == pytest.approx(0.001 + (0.005 - 0.001) * (100 - 54) / (100 - 8))


def test_warmup_decay_total_below_warmup_warns() -> None:
    with pytest.warns(UserWarning, match="total_num_steps 5 is less than warmup_num_steps 10"):
        WarmupDecayLR(_sgd(), total_num_steps=5, warmup_num_steps=10)


def test_warmup_cosine_pinned() -> None:
    sched = WarmupCosineLR(
        _sgd(lr=0.1),
        total_num_steps=20,
        warmup_min_ratio=0.1,
        warmup_num_steps=10,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    assert sched.get_last_lr() == [0.0]  # before the first step the ratio is 0
    assert _lr_at(sched, 0) == pytest.approx(0.1 * (0.1 + (0 / 10) * (1 - 0.1)))
    assert _lr_at(sched, 5) == pytest.approx(0.1 * (0.1 + (5 / 10) * (1 - 0.1)))
    assert _lr_at(sched, 10) == pytest.approx(0.1 * (0.01 + (1 - 0.01) * (1 + math.cos(math.pi * 1 / 10)) / 2))
    assert _lr_at(sched, 14) == pytest.approx(0.1 * (0.01 + (1 - 0.01) * (1 + math.cos(math.pi * 5 / 10)) / 2))
    assert _lr_at(sched, 19) == pytest.approx(0.1 * 0.01)  # progress 10/10
    assert _lr_at(sched, 40) == pytest.approx(0.1 * 0.01)  # progress clamped to 1


def test_warmup_cosine_log_warmup() -> None:
    sched = WarmupCosineLR(_sgd(lr=0.2), total_num_steps=100, warmup_num_steps=16)
    assert _lr_at(sched, 3) == pytest.approx(0.2 * (0.0 + math.log(3 + 1) / math.log(16) * (1 - 0.0)))


def test_lr_range_test_pinned() -> None:
    sched = LRRangeTest(_sgd(), lr_range_test_min_lr=0.001, lr_range_test_step_size=10, lr_range_test_step_rate=2.0)
    assert sched.get_last_lr() == [0.001]
    sched.step()  # iteration 0 -> interval (0 + 1) / 10
    assert sched.get_last_lr()[0] == pytest.approx(0.001 * (1 + 2.0 * 1 / 10))
    assert _lr_at(sched, 4) == pytest.approx(0.001 * (1 + 2.0 * 5 / 10))
    stairs = LRRangeTest(
        _sgd(),
        lr_range_test_min_lr=0.001,
        lr_range_test_step_size=10,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=True,
    )
    assert _lr_at(stairs, 4) == pytest.approx(0.001 * (1 + 2.0 * 0))  # floor(5/10) = 0
    assert _lr_at(stairs, 9) == pytest.approx(0.001 * (1 + 2.0 * 1))  # floor(10/10) = 1


def test_one_cycle_lr_and_momentum() -> None:
    opt = _adam()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.001,
        cycle_max_lr=0.011,
        cycle_first_step_size=10,
        decay_lr_rate=0.5,
        decay_step_size=5,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    group = opt.param_groups[0]
    assert group["lr"] == 0.001 and group["betas"] == (0.8, 0.99)  # construction: min lr, min momentum
    sched.step()  # iteration 0: batch 1 of a 20-step cycle, x = 1/20, scale = x / 0.5
    assert group["lr"] == pytest.approx(0.001 + (0.011 - 0.001) * (1 / 20) / 0.5)
    assert group["betas"][0] == pytest.approx(0.9 - (0.9 - 0.8) * (1 / 20) / 0.5)
    assert group["betas"][1] == 0.99
    sched.step(9)  # batch 10: the peak
    assert group["lr"] == pytest.approx(0.011) and group["betas"][0] == pytest.approx(0.8)
    sched.step(14)  # batch 15: x = 0.75, scale = (0.75 - 1) / (0.5 - 1)
    assert group["lr"] == pytest.approx(0.001 + (0.011 - 0.001) * 0.5)
    assert group["betas"][0] == pytest.approx(0.9 - (0.9 - 0.8) * 0.5)
    sched.step(20)  # decay phase: interval (20 - 20 + 1) / 5
    assert group["lr"] == pytest.approx(0.001 / (1 + 0.5 * (1 / 5)))
    assert group["betas"][0] == pytest.approx(0.9 * (1 + 0.1 * (1 / 5)))
    sched.step(29)
    assert group["lr"] == pytest.approx(0.001 / (1 + 0.5 * (10 / 5)))
    assert sched.get_last_lr() == pytest.approx([0.001 / 2])


def test_one_cycle_stairs_and_no_decay() -> None:
    sched = OneCycle(
        _sgd(),
        cycle_min_lr=0.001,
        cycle_max_lr=0.011,
        cycle_first_step_size=10,
        cycle_first_stair_count=2,
        cycle_momentum=False,
    )
    assert _lr_at(sched, 3) == pytest.approx(0.001)  # floor(4 * 2 / 10) / 2 = 0
    assert _lr_at(sched, 5) == pytest.approx(0.001 + 0.01 * 0.5)  # floor(6 * 2 / 10) / 2 = 0.5
    assert _lr_at(sched, 9) == pytest.approx(0.011)
    assert _lr_at(sched, 15) == pytest.approx(0.001)  # floor((20 - 16) * 2 / 10) / 2 = 0
    assert _lr_at(sched, 100) == pytest.approx(0.001)  # decay_step_size 0: hold the min lr


def test_one_cycle_without_betas_warns_and_skips_momentum() -> None:
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        sched = OneCycle(_sgd(), cycle_min_lr=0.01, cycle_max_lr=0.1)
    sched.step()
    assert "betas" not in sched.optimizer.param_groups[0]
    assert sched.get_mom() is None


def test_state_dict_round_trip_and_explicit_iteration() -> None:
    sched = WarmupLR(_sgd(), warmup_max_lr=0.01, warmup_num_steps=10)
    for _ in range(4):
        sched.step()
    assert sched.state_dict() == {"last_batch_iteration": 3}
    fresh = WarmupLR(_sgd(), warmup_max_lr=0.01, warmup_num_steps=10)
    fresh.load_state_dict(sched.state_dict())
    fresh.step()
    assert fresh.get_last_lr()[0] == pytest.approx(0.01 * math.log(4 + 1) / math.log(10))


def test_resume_without_step_has_no_last_lr() -> None:
    sched = WarmupLR(_sgd(lr=0.5), warmup_max_lr=0.01, last_batch_iteration=5)
    assert sched.optimizer.param_groups[0]["lr"] == 0.5  # untouched until step()
    with pytest.raises(RuntimeError, match="call step"):
        sched.get_last_lr()


def test_tensor_lr_stays_a_tensor() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.1))
    sched = WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.005)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_num_steps": 0}, "warmup_num_steps"),
        ({"warmup_num_steps": -3}, "warmup_num_steps"),
        ({"warmup_num_steps": 2.5}, "warmup_num_steps"),
        ({"warmup_min_lr": [0.0, 0.1]}, "warmup_min_lr"),
    ],
)
def test_warmup_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WarmupLR(_sgd(), **kwargs)


def test_total_and_cosine_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupDecayLR(_sgd(), total_num_steps=-1)
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(_sgd(), lr_range_test_step_size=0)
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(_sgd(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0)


def test_unknown_warmup_type_warns_and_uses_log() -> None:
    """DeepSpeed's fallback (its test_warmup_cosine_lr_unknown_warmup_type_falls_back_to_log)."""
    with pytest.warns(UserWarning, match="unknown warmup_type 'cosine'"):
        sched = WarmupLR(_sgd(), warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="cosine")
    assert sched.warmup_type == "log"
    assert _lr_at(sched, 4) == pytest.approx(0.01 * math.log(5) / math.log(10))
    with pytest.warns(UserWarning, match="unknown warmup_type 'exp'"):
        cosine = WarmupCosineLR(_sgd(lr=0.1), total_num_steps=100, warmup_num_steps=10, warmup_type="exp")
    assert _lr_at(cosine, 4) == pytest.approx(0.1 * math.log(5) / math.log(10))


def test_warmup_max_lr_defaults_to_each_groups_own_lr() -> None:
    opt = torch.optim.SGD(
        [
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2},
        ]
    )
    sched = WarmupLR(opt, warmup_num_steps=10)
    assert sched.max_lrs == [0.1, 0.2]
    sched.step(10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])


def test_one_cycle_zero_second_step_and_betas_pairs() -> None:
    sched = OneCycle(
        _adam(),
        cycle_min_lr=0.001,
        cycle_max_lr=0.1,
        cycle_first_step_size=10,
        cycle_second_step_size=0,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
    )
    assert sched.step_ratio == 1.0
    sched.step(4)  # batch 5 of a 10-step rise
    assert sched.get_lr() == pytest.approx([0.001 + (0.1 - 0.001) * 0.5])
    assert sched.get_mom() == [pytest.approx((0.85, 0.99))]  # (momentum, beta2) as DeepSpeed returns it
    assert sched.optimizer.param_groups[0]["betas"] == pytest.approx((0.85, 0.99))
    with pytest.raises(ValueError, match="cycle_second_step_size"):
        OneCycle(_sgd(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_second_step_size=-1)
