"""The batch triple:
train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size.

DeepSpeed's `_set_batch_related_parameters`: any two derive the third; only train_batch_size gives
gradient_accumulation_steps 1; only the micro batch gives gradient_accumulation_steps 1; neither is an error.
Unlike DeepSpeed's integer division, a derivation that does not divide evenly is an error naming the numbers.
An "auto" member arrives here as missing and is derived like one (its source says so).

The world_size of the triple is DeepSpeed's config's: the ranks over the sequence-parallel size, tensor-parallel
ranks included (`batch_plan` gets the data-parallel world and counts each TP group's ranks). DeepSpeed reads the
batch before AutoTP builds its groups, so a TP group counts as that many data-parallel ranks there even though
its ranks read the same batch: TP=2 on 2 ranks takes train_batch_size 8 = micro 4 x accumulation 1 x 2 (what
Transformers' Trainer fills in from its world size), and train_batch_size 4 alone gives micro 2.
"""

from __future__ import annotations

import dataclasses
import json
import os

from slipstream.config.keys import BATCH_KEYS
from slipstream.config.plan import BatchPlan
from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["AUTO_MARK", "apply_elasticity", "batch_plan", "mark_elastic"]

_TBS, _MICRO, _GAS = BATCH_KEYS
AUTO_MARK = ' (was "auto")'
"""The end of a batch source derived for a key given as "auto" (config/notices.py logs those)."""


def apply_elasticity(cfg: DeepSpeedConfig, ws: int, problems: list[str]) -> DeepSpeedConfig | None:
    """With `elasticity.enabled`: the batch triple from the elastic algorithm (config/elasticity.py) for this
    world size, as DeepSpeed's config does. Batch keys given beside it are an error unless
    `ignore_non_elastic_batch_info` (then they are replaced); a scheduler's copy of the section in
    DEEPSPEED_ELASTICITY_CONFIG must agree on the keys that decide the batch. None after a problem."""
    section = cfg.elasticity
    if not section.enabled:
        return cfg
    from slipstream.config.elasticity import ElasticityError, elastic_result

    given = [key for key in BATCH_KEYS if getattr(cfg, key) is not None]
    if given and not section.ignore_non_elastic_batch_info:
        problems.append(
            f"{', '.join(given)}: set together with elasticity.enabled; the elastic algorithm chooses "
            "the batch, so remove them or set elasticity.ignore_non_elastic_batch_info to true"
        )
        return None
    disagreement = _scheduler_disagreement(section.model_dump())
    if disagreement:
        problems.extend(disagreement)
        return None
    try:
        result = elastic_result(section, world_size=ws)
    except ElasticityError as error:
        text = str(error)
        problems.append(text if text.startswith("elasticity") else f"elasticity: {text}")
        return None
    micro = result.micro_batch_size or 1
    data_parallel = ws // section.model_parallel_size
    return cfg.model_copy(
        update={_TBS: result.train_batch_size, _MICRO: micro, _GAS: result.train_batch_size // (micro * data_parallel)}
    )


def _scheduler_disagreement(runtime: dict) -> list[str]:
    raw = os.environ.get("DEEPSPEED_ELASTICITY_CONFIG")
    if not raw:
        return []
    try:
        scheduler = json.loads(raw)
    except ValueError:
        return [f"DEEPSPEED_ELASTICITY_CONFIG: not JSON ({raw[:80]!r})"]
    scheduler = scheduler.get("elasticity", scheduler) if isinstance(scheduler, dict) else {}
    return [
        f"elasticity.{key}: {runtime.get(key)!r} here, but the scheduler's copy (DEEPSPEED_ELASTICITY_CONFIG) "
        f"has {scheduler.get(key)!r}; both must use the same elastic settings"
        for key in ("max_train_batch_size", "micro_batch_sizes", "version")
        if key in scheduler and scheduler[key] != runtime.get(key)
    ]


def batch_plan(cfg: DeepSpeedConfig, data_world: int, auto: list[str], problems: list[str]) -> BatchPlan | None:
    """DeepSpeed's `_set_batch_related_parameters`: any two of the triple derive the third, over `data_world`
    (the data-parallel ranks) times the TP size (see the module doc)."""
    ws = data_world * max(cfg.tensor_parallel.autotp_size, 1)
    tbs, micro, gas = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    sources = {key: "given" for key, v in zip(BATCH_KEYS, (tbs, micro, gas), strict=True) if v is not None}
    derived: dict[str, tuple[int, str]] = {}

    def split(total: int, by: int, by_text: str, target: str) -> int | None:
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
        sources[key] = text + (AUTO_MARK if key in auto else "")
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


def mark_elastic(batch: BatchPlan, cfg: DeepSpeedConfig) -> BatchPlan:
    """Sources that say the elastic algorithm chose the triple (it looks "given" to batch_plan)."""
    if not cfg.elasticity.enabled:
        return batch
    return dataclasses.replace(batch, sources=dict.fromkeys(BATCH_KEYS, "elasticity (config/elasticity.py)"))
