"""`zeropp_loco_param` becomes Stage3Plan.loco with zero_quantized_gradients at stage 3; its two keys are checked
(err_beta in [0, 1), reset_T an integer >= 1, both required, no other key) with errors naming the key and value;
without qgZ (or below stage 3) the key is reported by name and the plan has no LoCo."""

from __future__ import annotations

import pytest

from slipstream.config.errors import ConfigError
from slipstream.config.plan import LocoPlan
from slipstream.config.resolve import resolve

KEY = "zero_optimization.zeropp_loco_param"


def _resolve(loco: object, *, stage: int = 3, qgz: bool = True):  # type: ignore[no-untyped-def]
    zero = {"stage": stage, "zero_quantized_gradients": qgz, "zeropp_loco_param": loco}
    return resolve({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=2)


def test_the_section_reaches_the_plan() -> None:
    plan = _resolve({"err_beta": 0.8, "reset_T": 1024})
    assert plan.zero.stage3.loco == LocoPlan(err_beta=0.8, reset_every=1024)
    assert KEY not in plan.unimplemented
    assert _resolve({"err_beta": 0, "reset_T": 1}).zero.stage3.loco == LocoPlan(err_beta=0.0, reset_every=1)


@pytest.mark.parametrize(
    ("loco", "message"),
    [
        ({"err_beta": 1.0, "reset_T": 8}, r"zeropp_loco_param\.err_beta: 1\.0 is not a number in \[0, 1\)"),
        ({"err_beta": -0.1, "reset_T": 8}, r"err_beta: -0\.1 is not"),
        ({"err_beta": 0.8, "reset_T": 0}, r"zeropp_loco_param\.reset_T: 0 is not an integer >= 1"),
        ({"err_beta": 0.8, "reset_T": 2.5}, r"reset_T: 2\.5 is not an integer"),
        ({"err_beta": 0.8}, r"reset_T: None is not an integer >= 1"),
        ({"err_beta": 0.8, "reset_T": 8, "beta": 1}, r"zeropp_loco_param\.beta: not a LoCo key"),
    ],
)
def test_bad_values_are_refused_by_name(loco: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _resolve(loco)


@pytest.mark.parametrize(("stage", "qgz"), [(3, False), (2, True)])
def test_without_qgz_at_stage_3_the_key_is_reported(stage: int, qgz: bool) -> None:
    plan = _resolve({"err_beta": 0.8, "reset_T": 1024}, stage=stage, qgz=qgz)
    assert KEY in plan.unimplemented
    assert plan.zero.stage3 is None or plan.zero.stage3.loco is None
