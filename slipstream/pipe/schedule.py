"""Schedules as per-rank action lists: which (virtual stage, F/B/I/W, micro-batch) each pipeline stage runs.

1F1B (DeepSpeed's schedule) is written here: one stage per rank, warm-up of `P - rank - 1` forwards, then
one forward and one backward in turn, then the remaining backwards. The interleaved and zero-bubble orders
are torch.distributed.pipelining's own (`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`,
`ScheduleZBVZeroBubble`): their per-rank action tables are computed by torch's code and executed by
Slipstream's runtime (pipe/runtime.py), which sends pytrees of varying shapes, runs ZeRO's gradient hooks and
fails with the collective timeout. torch's own runtime needs PipelineStage objects with fixed, tensor-only
activations and waits on the backend without Slipstream's deadlines, so only the tables are taken.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from slipstream.utils.torch_versions import TorchTooOld

__all__ = ["SCHEDULES", "Action", "actions_for"]


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    stage: int
    """Virtual stage index."""
    kind: str
    """'F' forward, 'B' full backward, 'I' input-gradient backward, 'W' weight-gradient backward."""
    micro: int


SCHEDULES = {
    "1f1b": ("ours", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2, "v"),
}
"""name -> (where the order comes from, default chunks per stage, chunk layout)."""


def _one_f_one_b(rank: int, stages: int, micros: int) -> list[Action]:
    warmup = min(stages - rank - 1, micros)
    out = [Action(rank, "F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while forward < micros:
        out.append(Action(rank, "F", forward))
        forward += 1
        out.append(Action(rank, "B", backward))
        backward += 1
    out += [Action(rank, "B", m) for m in range(backward, micros)]
    return out


def _torch_table(class_name: str, rank: int, stages: int, chunks: int, micros: int) -> list[Action]:
    try:
        return _read_torch_table(class_name, rank, stages, chunks, micros)
    except (ImportError, AttributeError, TypeError, KeyError) as exc:
        import torch

        raise TorchTooOld(
            f"the pipeline schedule from torch.distributed.pipelining.{class_name} could not be read with torch "
            f"{torch.__version__} ({type(exc).__name__}: {exc}); Slipstream reads its tables as torch 2.13 lays "
            "them out. Use schedule='1f1b' (Slipstream's own) or torch 2.13"
        ) from exc


def _read_torch_table(class_name: str, rank: int, stages: int, chunks: int, micros: int) -> list[Action]:
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, class_name)
    rounds = max(1, micros // stages)
    if micros % rounds:
        raise ValueError(f"{class_name} needs the micro-batch count ({micros}) to be a multiple of {rounds}")
    shim: Any = types.SimpleNamespace(
        n_local_stages=chunks,
        pp_group_size=stages,
        _n_microbatches=micros,
        number_of_rounds=rounds,
        microbatches_per_round=micros // rounds,
        num_stages=stages * chunks,
        rank=rank,
    )
    if class_name == "ScheduleInterleavedZeroBubble":
        shim.pipeline_order = {r: cls._calculate_single_rank_operations(shim, r) for r in range(stages)}
        table = cls._add_bubbles_to_actions(shim, stages * chunks)[rank]
    else:
        table = cls._calculate_single_rank_operations(shim, rank)
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    out = []
    for action in table:
        if action is None:
            continue
        kind = kinds[action.computation_type.value]
        out.append(Action(int(action.stage_index), kind, int(action.microbatch_index)))
    return out


def actions_for(schedule: str, *, rank: int, stages: int, chunks: int, micros: int) -> list[Action]:
    """The actions pipeline stage `rank` runs for one batch of `micros` micro-batches."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not known; use one of {sorted(SCHEDULES)}")
    source = SCHEDULES[schedule][0]
    if source == "ours":
        if chunks != 1:
            raise ValueError(f"schedule '1f1b' runs one chunk per stage; the module has stage_chunks={chunks}")
        return _one_f_one_b(rank, stages, micros)
    if source == "ScheduleZBVZeroBubble" and chunks != 2:
        raise ValueError(f"schedule 'zbv_zero_bubble' needs stage_chunks=2 (got {chunks})")
    return _torch_table(source, rank, stages, chunks, micros)
