"""The batch triple:
train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size.

DeepSpeed's `_set_batch_related_parameters`: any two derive the third; only train_batch_size gives
gradient_accumulation_steps 1; only the micro batch gives gradient_accumulation_steps 1; neither is an error.
Unlike DeepSpeed's integer division, a derivation that does not divide evenly is an error naming the numbers.
An "auto" member arrives here as missing and is derived like one (its source says so).
"""

from __future__ import annotations

from typing import Optional

from slipstream.config.keys import BATCH_KEYS
from slipstream.config.plan import BatchPlan
from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["batch_plan"]

_TBS, _MICRO, _GAS = BATCH_KEYS


def batch_plan(cfg: DeepSpeedConfig, ws: int, auto: list[str], problems: list[str]) -> Optional[BatchPlan]:
    """DeepSpeed's `_set_batch_related_parameters`: any two of the triple derive the third."""
    tbs, micro, gas = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    sources = {key: "given" for key, v in zip(BATCH_KEYS, (tbs, micro, gas), strict=True) if v is not None}
    derived: dict[str, tuple[int, str]] = {}

    def split(total: int, by: int, by_text: str, target: str) -> Optional[int]:
        if total % by:
            problems.append(
                f"{_TBS}: {total} is not divisible by {by_text} = {by}, so {target} cannot be "
                f"derived; set {_TBS} to a multiple of {by} (e.g. {by * max(1, total // by)} or "
                f"{by * (total // by + 1)}) or set {target}"
            )
            return None
        return total // by

    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * ws:
            problems.append(_inconsistent(tbs, micro, gas, ws))
            return None
    elif tbs is not None and micro is not None:
        gas = split(tbs, micro * ws, f"{_MICRO} * world_size = {micro} * {ws}", _GAS)
        derived[_GAS] = (gas or 0, f"derived: {tbs} / ({micro} * {ws})")
    elif tbs is not None and gas is not None:
        micro = split(tbs, gas * ws, f"{_GAS} * world_size = {gas} * {ws}", _MICRO)
        derived[_MICRO] = (micro or 0, f"derived: {tbs} / ({gas} * {ws})")
    elif micro is not None and gas is not None:
        tbs = micro * gas * ws
        derived[_TBS] = (tbs, f"derived: {micro} * {gas} * {ws}")
    elif tbs is not None:
        gas, micro = 1, split(tbs, ws, "world_size", _MICRO)
        derived[_GAS] = (1, f"derived: 1 (only {_TBS} given)")
        derived[_MICRO] = (micro or 0, f"derived: {tbs} / {ws}")
    elif micro is not None:
        gas, tbs = 1, micro * ws
        derived[_GAS] = (1, f"derived: 1 (no {_TBS} given)")
        derived[_TBS] = (tbs, f"derived: {micro} * 1 * {ws}")
    else:
        problems.append(_no_batch_problem(auto))
        return None
    if tbs is None or micro is None or gas is None:
        return None
    for key, (_, text) in derived.items():
        sources[key] = text + (' (was "auto")' if key in auto else "")
    return BatchPlan(
        train_batch_size=tbs,
        micro_batch_size=micro,
        gradient_accumulation_steps=gas,
        world_size=ws,
        sources=sources,
    )


def _inconsistent(tbs: int, micro: int, gas: int, ws: int) -> str:
    product = micro * gas * ws
    if tbs % (micro * ws) == 0:
        other = f"{_GAS} to {tbs // (micro * ws)}"
    elif tbs % (gas * ws) == 0:
        other = f"{_MICRO} to {tbs // (gas * ws)}"
    else:
        other = f"remove {_GAS} and set {_TBS} to a multiple of {micro * ws}"
    return (
        f"{_TBS}: {tbs} != {_MICRO} {micro} * {_GAS} {gas} * world_size {ws} = {product}; "
        f"set {_TBS} to {product}, or {other}"
    )


def _no_batch_problem(auto: list[str]) -> str:
    if auto:
        return (
            f'{", ".join(auto)}: "auto" cannot be derived: at least one of {_TBS} or {_MICRO} needs a '
            'number; the caller (e.g. Transformers\' Trainer) fills "auto" in, or replace it with a value'
        )
    return f"{_TBS}, {_MICRO}: either {_TBS} or {_MICRO} needs to be provided ({_GAS} alone is not enough)"
