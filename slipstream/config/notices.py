"""Notices: what a run tells its user about DeepSpeed settings it accepts but does not act on, and about the
values it chose for "auto" batch keys.

A notice about a setting goes out once per key per process, two ways: a `UserWarning` on every rank (what
`pytest.warns` and `-W error` see) and a WARNING record of the `slipstream` logger on rank 0, so a script
that runs `warnings.filterwarnings("ignore")` still has it in its log. Each names the setting and what the
run does instead. The plan's `unimplemented` config keys and zero.Init's DeepSpeed-only keywords both go
through `notice()`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from typing import Any

from pydantic.fields import FieldInfo

from slipstream.config.batch import AUTO_MARK
from slipstream.config.keys import BATCH_KEYS
from slipstream.config.plan import BatchPlan, EnginePlan
from slipstream.config.schema.base import accepted_keys, model_of
from slipstream.config.schema.top import DeepSpeedConfig
from slipstream.utils.logging import first_time, get_logger, log_rank0

__all__ = ["instead_of", "notice", "report_plan"]


def notice(key: str, message: str, *, rank: int) -> None:
    """`message` about the setting `key`, once per process: logged on rank 0 (first, so a warnings filter set
    to "error" cannot swallow it), then warned on every rank."""
    if not first_time(f"notice:{key}"):
        return
    if rank == 0:
        get_logger().warning(message)
    warnings.warn(message, UserWarning, stacklevel=3)


def report_plan(plan: EnginePlan, *, rank: int) -> None:
    """The engine's notices for a resolved config: each key accepted but not implemented, and each batch key
    that was "auto" with the value it resolved to."""
    report_unimplemented(plan.unimplemented, rank=rank)
    report_auto_batch(plan.batch, rank=rank)


def report_unimplemented(keys: Iterable[str], *, rank: int) -> None:
    for key in keys:
        notice(
            f"config:{key}",
            f"slipstream: config key '{key}' is accepted but not implemented yet; {instead_of(key)}",
            rank=rank,
        )


def instead_of(key: str) -> str:
    """What a run does instead of acting on the dotted config key `key` (an entry of the plan's
    `unimplemented`)."""
    if key.startswith("optimizer.type="):
        return "the optimizer passed to initialize() is used instead"
    if key in _INSTEAD:
        return _INSTEAD[key]
    info = _field(key)
    if info is None:
        return "the run ignores it"
    if model_of(info.annotation) is not None:
        return "the run goes on without this section"
    default = info.get_default(call_default_factory=True)
    if default is None:
        return "the run goes on as if it were not set"
    return f"the run goes on as with its default, {_text(default)}"


_INSTEAD = {
    "zero_optimization.reduce_bucket_size": "at ZeRO stage 3 each unit's gradients are reduce-scattered together "
    "when the unit's backward completes, whatever the bucket size (stages 1 and 2 use it)",
    "eigenvalue.quantize_training": "the block eigenvalues go to the monitors only; no quantization schedule reads them",
}
"""What a run does instead, for keys whose schema default does not say it (see instead_of)."""


def _field(key: str) -> FieldInfo | None:
    """The schema field of a dotted config key (aliases accepted), None for a key an open section kept."""
    model: Any = DeepSpeedConfig
    info = None
    for part in key.split("."):
        name = None if model is None else accepted_keys(model).get(part)
        if name is None:
            return None
        info = model.model_fields[name]
        model = model_of(info.annotation)
    return info


def _text(value: object) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def report_auto_batch(batch: BatchPlan, *, rank: int) -> None:
    """Log (rank 0) each batch key given as "auto" outside Transformers/Accelerate (they fill "auto" in before
    the engine sees it): the value it resolved to and the keys it came from."""
    values = dict(zip(BATCH_KEYS, (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps)))
    given = [f"{key} {values[key]}" for key in BATCH_KEYS if batch.sources.get(key) == "given"]
    for key in BATCH_KEYS:
        source = batch.sources.get(key, "")
        if not source.endswith(AUTO_MARK):
            continue
        how = source.removesuffix(AUTO_MARK).removeprefix("derived: ")
        log_rank0(
            f'config: {key} "auto" resolved to {values[key]} ({how}) from {" and ".join(given) or "no batch key"} '
            f"and {batch.world_size} data-parallel rank(s)",
            rank=rank,
        )
