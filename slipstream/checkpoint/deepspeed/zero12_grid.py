"""A DeepSpeed ZeRO-1/2 checkpoint folder saved with tensor and/or pipeline parallelism (Megatron-DeepSpeed's
layout; AutoTP's at ZeRO-1/2) as each tensor-parallel rank's whole shards.

Owns `read_zero12_shards`. The layout it reads: `mp_rank_<i>_model_states.pt` per (pipeline stage, tensor
rank), i = pp * tp_degree + tp, each recording the shapes of its own shards (`param_shapes`), and one optimizer
file per (pp, tp, dp) rank (layout.py's numbering). In an optimizer file, group g's flat fp32 partition
(`single_partition_of_fp32_groups[g]`) and the base optimizer's flat moments hold the fragments that
`param_slice_mappings[g][name]` (start, numel) locate; a parameter's fragments over the data-parallel ranks,
in rank order, are its shard. Parameters that `pipeline_replicated_parameter_patterns` name (tied embeddings)
are taken from the first stage only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.constants import (
    BASE_OPTIMIZER_STATE,
    FP32_WEIGHT_KEY,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARAM_SLICE_MAPPINGS,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    UNIVERSAL_CHECKPOINT_INFO,
)
from slipstream.checkpoint.deepspeed.folder import DeepSpeedCheckpointFolder
from slipstream.checkpoint.deepspeed.layout import shapes_per_tp_rank
from slipstream.checkpoint.deepspeed.safe_pickle import DeepSpeedStub
from slipstream.checkpoint.deepspeed.tp_shards import TpShards, check_conversion_support
from slipstream.checkpoint.errors import CheckpointError

__all__ = ["read_zero12_shards"]

MOMENTS = ("exp_avg", "exp_avg_sq")
_SHARDED = (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)


def _address(value: Any, where: str) -> tuple[int, int]:
    """(start, numel) of a fragment address (DeepSpeed's `fragment_address`, read as a stub)."""
    fields = value.state if isinstance(value, DeepSpeedStub) else getattr(value, "__dict__", value)
    try:
        return int(fields["start"]), int(fields["numel"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: a param_slice_mappings entry without start/numel: {value!r}") from exc


def _optimizer(folder: DeepSpeedCheckpointFolder, pp: int, tp: int, dp: int) -> Mapping[str, Any]:
    state = folder.get_zero_checkpoint_state(pp, tp, dp)
    optimizer = state.get(OPTIMIZER_STATE_DICT)
    if not isinstance(optimizer, Mapping) or PARAM_SLICE_MAPPINGS not in optimizer:
        raise CheckpointError(
            f"{folder.get_zero_files(pp, tp, dp)}: no {OPTIMIZER_STATE_DICT}.{PARAM_SLICE_MAPPINGS}; the file is not "
            "a DeepSpeed ZeRO-1/2 optimizer file of a version that records where each parameter lies (>= 0.10)"
        )
    return optimizer


def read_zero12_shards(folder_path: str | Path, *, require_info: bool = True) -> TpShards:
    """Read a ZeRO-1/2 tag folder into each tensor-parallel rank's whole shards (restricted unpickler).

    `require_info`: refuse, before reading any optimizer file, a folder whose model-states files record no
    `universal_checkpoint_info` (the merge rules; without them a replicated norm would be concatenated like a
    sharded weight). DeepSpeed's converter refuses it too unless told `--inject_missing_state`."""
    folder = DeepSpeedCheckpointFolder(str(folder_path))
    pp_degree, tp_degree = folder.pp_degree, folder.tp_degree
    recorded = folder.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
    if recorded is None and require_info:
        raise CheckpointError(
            f"{folder_path}: the model-states files record no {UNIVERSAL_CHECKPOINT_INFO} (which parameters are "
            "replicated, row-parallel, fused), so the tensor-parallel shards cannot be merged safely; the training "
            "script must record it, or pass --inject_missing_state to concatenate every parameter along dim 0"
        )
    check_conversion_support(recorded)
    info = dict(recorded or {})
    replicated = list(info.get(PIPELINE_REPLICATED_PARAMETER_PATTERNS, []))
    shapes_by_file = []
    for file, meta in folder.model_state_metadata:
        if not isinstance(meta[PARAM_SHAPES], dict):
            raise CheckpointError(f"{file}: no {PARAM_SHAPES} list of dicts; not a ZeRO-1/2 model-states file")
        shapes_by_file.append(meta[PARAM_SHAPES])
    per_tp = shapes_per_tp_rank(shapes_by_file, pp_degree, tp_degree)
    names = list(dict.fromkeys(name for shapes in shapes_by_file for name in shapes))
    pieces, steps = _slices_per_tp_rank(folder, replicated)
    shards = _whole_shards(folder, pieces, per_tp)
    first = _optimizer(folder, 0, 0, 0)
    optimizer_state = {key: value for key, value in first.items() if key not in _SHARDED}
    optimizer_state[PARAM_GROUPS] = first[BASE_OPTIMIZER_STATE][PARAM_GROUPS]
    return TpShards(
        shards=shards,
        names=[name for name in names if any(name in shard for shard in shards)],
        universal_info=None if recorded is None else info,
        optimizer_state=optimizer_state,
        model_files=[Path(f) for f in folder.mp_rank_files],
        steps=steps,
    )


def _slices_per_tp_rank(
    folder: DeepSpeedCheckpointFolder, replicated: list[str]
) -> tuple[list[dict[str, dict[str, list[torch.Tensor]]]], dict[str, Any]]:
    """Every optimizer file's slices, per tensor rank, name and state in (pipeline, data-parallel) order; and
    each parameter's step. A parameter matching `replicated` is read from the first pipeline stage only."""
    pieces: list[dict[str, dict[str, list[torch.Tensor]]]] = [{} for _ in range(folder.tp_degree)]
    steps: dict[str, Any] = {}
    for pp in range(folder.pp_degree):
        for tp in range(folder.tp_degree):
            for dp in range(folder.dp_degree):
                where = ", ".join(folder.get_zero_files(pp, tp, dp))
                optimizer = _optimizer(folder, pp, tp, dp)
                groups = optimizer[BASE_OPTIMIZER_STATE]["state"]
                fp32 = optimizer[SINGLE_PARTITION_OF_FP32_GROUPS]
                for g, mapping in enumerate(optimizer[PARAM_SLICE_MAPPINGS]):
                    group = groups[g]
                    flats = {FP32_WEIGHT_KEY: fp32[g], **{m: group[m] for m in MOMENTS if m in group}}
                    for name, address in mapping.items():
                        if pp > 0 and any(re.match(p, name) for p in replicated):
                            continue  # a tied parameter: the first stage's copy is the one kept
                        start, numel = _address(address, where)
                        for state, flat in flats.items():
                            piece = flat.reshape(-1).narrow(0, start, numel)
                            pieces[tp].setdefault(name, {}).setdefault(state, []).append(piece)
                        if "step" in group:
                            steps.setdefault(name, group["step"])
    return pieces, steps


def _whole_shards(
    folder: DeepSpeedCheckpointFolder,
    pieces: list[dict[str, dict[str, list[torch.Tensor]]]],
    per_tp: dict[str, list[Any]],
) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Each tensor rank's slices joined into its whole shards, shaped as its model-states files record."""
    shards = []
    for tp, by_name in enumerate(pieces):
        shard = {}
        for name, states in by_name.items():
            shape = per_tp[name][tp]
            if shape is None:
                raise CheckpointError(
                    f"{folder.dir}: tensor rank {tp} holds optimizer state of {name}, but no model-states file of "
                    "that rank records its shape"
                )
            shard[name] = {state: torch.cat(parts).reshape(tuple(shape)) for state, parts in states.items()}
        shards.append(shard)
    return shards
