"""What the engine asks the planner at start: the one-line prediction for the actual run, and whether a stage-3
model was fully built on every rank (instead of under `zero.Init`) and is big enough to warn about.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slipstream.planner.estimate import estimate_option, settings_from_plan
from slipstream.planner.report import DEVICE_COLUMNS
from slipstream.planner.shapes import from_module
from slipstream.planner.types import OptionEstimate

GIB = 2**30
MATERIALISED_WARN_NUMEL = 1_000_000_000
"""Default threshold of `should_warn_materialised` (docs/design.md P10: warn above 1B parameters)."""


def engine_estimate(
    *, plan: object, model: object, world_size: int, gpus_per_node: int = 1, optimizer: str | None = None
) -> OptionEstimate:
    """The planner's figures for this engine's config (`EnginePlan`) and model.

    `model` may already be sharded (stage 3 parameters keep their global shapes); `optimizer` is the class or
    config name of the optimizer when it did not come from the config (it decides the optimizer-state size).
    """
    settings, option = settings_from_plan(plan)
    if optimizer is not None:
        settings = dataclasses.replace(settings, optimizer=optimizer, optimizer_params=())
    return estimate_option(from_module(model), option, settings=settings, world=world_size, gpus_per_node=gpus_per_node)


def engine_line(*, plan: Any, model: Any, world_size: int, gpus_per_node: int = 1, optimizer: str | None = None) -> str:
    """One log line for rank 0 at engine start: `engine_estimate`'s per-rank bytes by role. Activations are not
    included (the engine does not know the sequence length)."""
    est = engine_estimate(
        plan=plan, model=model, world_size=world_size, gpus_per_node=gpus_per_node, optimizer=optimizer
    )
    option, device, host = est.option, est.device, est.host
    offloads = [
        name
        for name, on in (("offload_optimizer", option.offload_optimizer), ("offload_param", option.offload_param))
        if on
    ]
    parts = ", ".join(f"{label} {_size(sum(device[r] for r in roles))}" for label, roles in DEVICE_COLUMNS)
    params = sum(p.numel() for p in model.parameters())
    return (
        f"planner: ZeRO-{option.stage}{' + ' + ' + '.join(offloads) if offloads else ''}, {params:,} params, "
        f"{world_size} ranks: per rank {_size(sum(device.values()))} on the device ({parts}; activations not "
        f"included), {_size(sum(host.values()))} on the host; model states {_size(est.model_states)} per rank "
        "(engine.optimizer.owned_bytes() counts the same)"
    )


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def should_warn_materialised(numel: int, world: int, threshold: int = MATERIALISED_WARN_NUMEL) -> bool:
    """True when a stage-3 run on `world` ranks got `numel` parameter elements fully materialised on every rank
    (built outside `zero.Init`) and that is more than `threshold`: every rank paid the whole model in host or
    device memory before sharding."""
    return world > 1 and numel > threshold


def materialised_warning(numel: int, world: int) -> str:
    """The warning text for `should_warn_materialised`."""
    return (
        f"ZeRO-3: the model's {numel:,} parameters were fully built on each of the {world} ranks before "
        f"sharding ({numel * 4 / GIB:.1f} GiB per rank in fp32, {numel * 4 * world / GIB:.1f} GiB across the "
        "ranks); build it under `with slipstream.zero.Init(config_dict_or_path=ds_config):` so each rank "
        "only ever holds its shard plus one module"
    )
