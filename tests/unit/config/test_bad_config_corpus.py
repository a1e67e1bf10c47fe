"""A corpus of broken configs generated from the schema and from the optimizer and scheduler signatures: every
key gets a value of the wrong kind and, where it has a range, one just outside it. Each must raise an error
that names the key (none may train silently)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import annotated_types
import pytest
import torch

from slipstream.config import ConfigError, OptimizerPlan, SchedulerPlan, resolve
from slipstream.config.keys import _json_key
from slipstream.config.optimizers import REGISTRY
from slipstream.config.schema.base import model_of
from slipstream.config.schema.top import DeepSpeedConfig
from slipstream.engine.lr_schedules import SCHEDULES
from slipstream.engine.optimizers import build_optimizer, build_scheduler
from slipstream.engine.param_check import RANGES, _hints, _kinds

BASE: dict[str, Any] = {"train_batch_size": 4}


def _fields(cls: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any, bool]]:
    for name, info in cls.model_fields.items():
        key = (*prefix, _json_key(cls, name))
        sub = model_of(info.annotation)
        yield key, info, sub is not None
        if sub is not None:
            yield from _fields(sub, key)


def _bad_values(info: Any, section: bool) -> list[Any]:
    if section:
        return [7]
    text = str(info.annotation).lower()
    values: list[Any] = []
    if "bool" in text and "int" not in text:
        values.append("yes")
    elif "int" in text or "float" in text:
        values.append("not-a-number")
    elif "literal" in text:
        values.append("no-such-choice")
    elif "str" in text:
        values.append(12345)
    for bound in info.metadata:
        if isinstance(bound, annotated_types.Ge):
            values.append(bound.ge - 1)
        elif isinstance(bound, annotated_types.Gt):
            values.append(bound.gt - 1)
        elif isinstance(bound, annotated_types.Le):
            values.append(bound.le + 1)
        elif isinstance(bound, annotated_types.Lt):
            values.append(bound.lt + 1)
    return values


def _nested(key: tuple[str, ...], value: Any) -> dict[str, Any]:
    config: dict[str, Any] = dict(BASE)
    place = config
    for part in key[:-1]:
        place = place.setdefault(part, {})
    place[key[-1]] = value
    return config


SCHEMA_CASES = [(".".join(key), value) for key, info, section in _fields(DeepSpeedConfig)
                for value in _bad_values(info, section)]


def test_the_corpus_covers_the_schema() -> None:
    keys = {key for key, _ in SCHEMA_CASES}
    assert len(SCHEMA_CASES) > 250 and "zero_optimization.stage" in keys and "fp16.loss_scale_window" in keys


@pytest.mark.parametrize("key, value", SCHEMA_CASES)
def test_each_broken_key_is_named(key: str, value: Any) -> None:
    if key == "train_batch_size":
        config = {key: value}
    else:
        config = _nested(tuple(key.split(".")), value)
    with pytest.raises(ConfigError) as caught:
        resolve(config, world_size=1)
    assert key.rsplit(".", 1)[-1] in str(caught.value), f"{key}={value!r}: the error does not name the key"


def _param_cases(section: str, classes: dict[str, Any]) -> list[tuple[str, str, Any]]:
    cases = []
    for name, cls in classes.items():
        hints = _hints(cls)
        for param in list(inspect.signature(cls.__init__).parameters.values())[2:]:
            kinds = _kinds(hints.get(param.name), param.default)
            if not kinds or param.name in ("last_batch_iteration",):
                continue
            cases.append((name, param.name, "nonsense" if "a string" not in kinds else 3))
            if param.name in RANGES:
                cases.append((name, param.name, -1.0 if param.name != "betas" else [0.9, 1.5]))
    return cases


def _optimizer_classes() -> dict[str, Any]:
    found = {}
    for name, spec in REGISTRY.items():
        module, _, attr = spec.target.partition(":")
        cls = getattr(__import__(module, fromlist=[attr]), attr, None)
        if cls is not None:
            found[name] = cls
    return found


@pytest.mark.parametrize("name, param, value", _param_cases("optimizer", _optimizer_classes()))
def test_each_broken_optimizer_param_is_named(name: str, param: str, value: Any) -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=rf"optimizer\.params\.{param}\b"):
        build_optimizer(OptimizerPlan(name=name, params={param: value}), model.parameters(), on_host=False)


@pytest.mark.parametrize("name, param, value", _param_cases("scheduler", SCHEDULES))
def test_each_broken_scheduler_param_is_named(name: str, param: str, value: Any) -> None:
    optimizer = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    required = {"total_num_steps": 10, "cycle_min_lr": 0.01, "cycle_max_lr": 0.1}
    params = {**{k: v for k, v in required.items() if k in inspect.signature(SCHEDULES[name]).parameters},
              param: value}
    with pytest.raises(ValueError, match=rf"scheduler\.params\.{param}\b"):
        build_scheduler(SchedulerPlan(name=name, params=params), optimizer)
