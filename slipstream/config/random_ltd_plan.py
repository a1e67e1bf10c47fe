"""`RandomLTDPlan`: random layerwise token dropping, resolved from `data_efficiency.data_routing.random_ltd`
(slipstream/data/random_ltd.py and random_ltd_layer.py build it; config/data_plans.py hangs it on `SchedulesPlan`).

DeepSpeed's rules kept here: the schedule needs min_value, max_value, require_steps and seq_per_step; the layer
ids are random_ltd_layer_num many. Its layer-token learning-rate schedule stays reported as not implemented
(DeepSpeed raises for it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slipstream.config.schema.data_routing import RandomLTDConfig

if TYPE_CHECKING:
    from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["RandomLTDPlan", "random_ltd_plan"]

_WHERE = "data_efficiency.data_routing.random_ltd"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RandomLTDPlan:
    """Which wrapped layers drop tokens and how many tokens they keep per step (field docs: the schema's keys)."""

    model_type: str
    """"decoder" | "encoder"."""
    hidden_state_order: str
    """"batch_seq_dim" | "seq_batch_dim"."""
    random_ltd_layer_num: int
    random_ltd_layer_id: tuple[int, ...]
    model_mask_name: str | None
    total_layer_num: int
    min_value: int
    max_value: int
    schedule_type: str
    require_steps: int
    seq_per_step: int


def random_ltd_plan(cfg: DeepSpeedConfig, problems: list[str]) -> RandomLTDPlan | None:
    """The plan when random_ltd is enabled (None otherwise); a missing or inconsistent key is a problem."""
    section = cfg.data_efficiency.data_routing.random_ltd
    if not section.enabled:
        return None
    schedule, steps = section.random_ltd_schedule, section.random_ltd_schedule.schedule_config
    given = {
        "random_ltd_layer_num": section.random_ltd_layer_num,
        "random_ltd_layer_id": section.random_ltd_layer_id,
        "total_layer_num": section.total_layer_num,
        "random_ltd_schedule.min_value": schedule.min_value,
        "random_ltd_schedule.max_value": schedule.max_value,
        "random_ltd_schedule.schedule_config.require_steps": steps.require_steps,
        "random_ltd_schedule.schedule_config.seq_per_step": steps.seq_per_step,
    }
    missing = [f"{_WHERE}.{key}" for key, value in given.items() if value is None]
    if missing:
        problems.append(f"{_WHERE} is enabled but {', '.join(missing)} is not set; set it (DeepSpeed requires it)")
        return None
    ids = tuple(section.random_ltd_layer_id or ())
    bad = _inconsistent(section, ids)
    if bad:
        problems.append(bad)
        return None
    return RandomLTDPlan(
        model_type=section.model_type,
        hidden_state_order=section.hidden_state_order,
        random_ltd_layer_num=len(ids),
        random_ltd_layer_id=ids,
        model_mask_name=section.model_mask_name,
        total_layer_num=int(section.total_layer_num or 0),
        min_value=int(schedule.min_value or 0),
        max_value=int(schedule.max_value or 0),
        schedule_type=schedule.schedule_type,
        require_steps=int(steps.require_steps or 0),
        seq_per_step=int(steps.seq_per_step or 0),
    )


def _inconsistent(section: RandomLTDConfig, ids: tuple[int, ...]) -> str | None:
    """What is wrong between the keys (None when they agree)."""
    schedule, steps = section.random_ltd_schedule, section.random_ltd_schedule.schedule_config
    if section.random_ltd_layer_num != len(ids):
        return (
            f"{_WHERE}.random_ltd_layer_num is {section.random_ltd_layer_num} but random_ltd_layer_id lists "
            f"{len(ids)} layers {list(ids)}; make them agree"
        )
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        return f"{_WHERE}.random_ltd_layer_id: expected distinct layer numbers >= 0, got {list(ids)}"
    low, high = schedule.min_value or 0, schedule.max_value or 0
    if not 1 <= low <= high:
        return f"{_WHERE}.random_ltd_schedule: expected 1 <= min_value <= max_value, got {low} and {high}"
    for key in ("require_steps", "seq_per_step"):
        value = getattr(steps, key)
        if value is not None and value < 1:
            return f"{_WHERE}.random_ltd_schedule.schedule_config.{key}: expected an integer >= 1, got {value}"
    if low < (steps.seq_per_step or 1):
        return (
            f"{_WHERE}.random_ltd_schedule: min_value {low} is below seq_per_step {steps.seq_per_step}, so the first "
            "steps would keep no token (the kept count is rounded down to a multiple of seq_per_step); raise min_value"
        )
    if (section.total_layer_num or 0) < len(ids):
        return f"{_WHERE}.total_layer_num {section.total_layer_num} is smaller than the {len(ids)} dropping layers"
    return None
