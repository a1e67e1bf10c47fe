"""The per-stage table rank 0 logs when a pipeline engine is built: each stage's layers, parameters, and the
planner's prediction of its per-rank model-state memory (planner/zero_bytes.py, for the stage's ZeRO stage
over its data-parallel group)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slipstream.planner.estimate import settings_from_plan
from slipstream.planner.zero_bytes import stage012_bytes

if TYPE_CHECKING:
    from slipstream.config.plan import EnginePlan
    from slipstream.pipe.module import PipelineModule


def stage_rows(module: PipelineModule, plan: EnginePlan, *, dp: int) -> list[dict[str, Any]]:
    settings, option = settings_from_plan(plan)
    rows = []
    for stage in range(module.num_stages):
        virtual = [v for v in range(module.num_virtual_stages) if module.stage_owner(v) == stage]
        layers = [i for v in virtual for i in range(module.parts[v], module.parts[v + 1])]
        counts = [module.layer_params[i] for i in layers if module.layer_params[i] > 0]
        figures = stage012_bytes(
            counts, 0, stage=plan.zero.stage, world=dp, settings=settings, offload=option.offload_optimizer
        )
        rows.append(
            {
                "stage": stage,
                "layers": layers,
                "params": sum(counts),
                "device_bytes": sum(figures.device.values()),
                "host_bytes": sum(figures.host.values()),
            }
        )
    return rows


def stage_table(module: PipelineModule, plan: EnginePlan, *, dp: int) -> str:
    names = module.layer_names()
    lines = [
        f"pipeline: {module.num_stages} stages x {dp} data-parallel, schedule {module.schedule}, "
        f"{module.stage_chunks} chunk(s) per stage, partition {module.partition_method!r}, ZeRO stage "
        f"{plan.zero.stage} inside each stage",
        f"{'stage':>5} {'layers':<28} {'params':>12} {'model states/rank (MiB)':>24}",
    ]
    for row in stage_rows(module, plan, dp=dp):
        span = f"{row['layers'][0]}-{row['layers'][-1]}" if row["layers"] else "-"
        kinds = ",".join(sorted({names[i] for i in row["layers"]}))
        lines.append(
            f"{row['stage']:>5} {(span + ' ' + kinds)[:28]:<28} {row['params']:>12,} "
            f"{row['device_bytes'] / 2**20:>24.2f}"
        )
    return "\n".join(lines)
