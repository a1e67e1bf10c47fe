"""A DeepSpeed ZeRO-3 checkpoint folder, with or without AutoTP tensor parallelism, as each tensor-parallel
rank's whole shards.

Owns `rank_grid` (the files `[bf16_]zero_pp_rank_<dp>_mp_rank_<tp>_{model,optim}_states.pt` as grid[tp][dp],
checked complete) and `read_tp_shards`. The layout it reads: each tensor-parallel rank's model-states file
records the shapes of its own shards (`param_shapes`, one dict per sub-group, so uneven splits are exact);
in each data-parallel rank's optimizer file, sub-group g's flat fp32 buffer (`fp32_flat_groups[g]`) and its
optimizer moments hold, for every parameter in order, `ceil(numel / partition_count)` elements, the rank's
piece of the flattened shard (the last pieces padded). `ds_zero_partition_groups[g]` may override the
partition count and rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.constants import (
    FP32_FLAT_GROUPS,
    FP32_WEIGHT_KEY,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    PARAM_SHAPES,
    UNIVERSAL_CHECKPOINT_INFO,
)
from slipstream.checkpoint.deepspeed.safe_pickle import safe_load
from slipstream.checkpoint.deepspeed.tp_shards import TpShards
from slipstream.checkpoint.errors import CheckpointError

__all__ = ["MOMENTS", "rank_grid", "read_zero3_shards", "zero3_files"]

MOMENTS = ("exp_avg", "exp_avg_sq")
_RANKS = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_")


def zero3_files(folder: Path, suffix: str) -> list[Path]:
    """The per-rank ZeRO-3 files of `folder` ending in `suffix` (`model_states.pt` or `optim_states.pt`)."""
    return sorted(p for p in folder.glob(f"*{suffix}") if _RANKS.match(p.name))


def rank_grid(files: Sequence[Path]) -> list[list[Path]]:
    """grid[tp][dp] -> file; every (tp, dp) pair up to the largest of each must be present."""
    grid: dict[int, dict[int, Path]] = {}
    for path in files:
        match = _RANKS.match(path.name)
        if match is None:
            raise CheckpointError(f"{path}: not a ZeRO-3 rank file name (zero_pp_rank_<dp>_mp_rank_<tp>_...)")
        grid.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    if not grid:
        raise CheckpointError("no ZeRO-3 rank files (zero_pp_rank_<dp>_mp_rank_<tp>_*) were found")
    tp = max(grid) + 1
    dp = max(max(ranks) for ranks in grid.values()) + 1
    missing = [(t, d) for t in range(tp) for d in range(dp) if d not in grid.get(t, {})]
    if missing:
        raise CheckpointError(
            f"the ZeRO-3 checkpoint {files[0].parent} is incomplete: no file for (tp_rank, dp_rank) {missing} of a "
            f"{tp} x {dp} grid; copy every rank's files"
        )
    return [[grid[t][d] for d in range(dp)] for t in range(tp)]


def _group_moments(inner: object, group: int) -> dict[str, torch.Tensor]:
    states = inner.get("state") if isinstance(inner, Mapping) else None
    if states is None:
        return {}
    entry = states[group] if isinstance(states, list) else states.get(group, {})
    return {key: entry[key] for key in MOMENTS if isinstance(entry.get(key), torch.Tensor)}


def _pieces_of_rank(
    optim_file: Path, shapes: Sequence[Mapping[str, Any]], dp_rank: int, dp_degree: int
) -> dict[str, dict[str, tuple[int, torch.Tensor]]]:
    loaded = safe_load(optim_file)
    outer = loaded.get(OPTIMIZER_STATE_DICT) if isinstance(loaded, Mapping) else None
    if not isinstance(outer, Mapping) or FP32_FLAT_GROUPS not in outer:
        raise CheckpointError(f"{optim_file} has no {OPTIMIZER_STATE_DICT}.{FP32_FLAT_GROUPS}: not a ZeRO-3 file")
    flat_groups = outer[FP32_FLAT_GROUPS]
    if len(flat_groups) < len(shapes):
        raise CheckpointError(
            f"{optim_file}: {len(flat_groups)} flat fp32 groups for {len(shapes)} parameter sub-groups in the "
            "model-states file; the files belong to different checkpoints"
        )
    partitions = outer.get("ds_zero_partition_groups") or []
    out: dict[str, dict[str, tuple[int, torch.Tensor]]] = {}
    for g, group_shapes in enumerate(shapes):
        flats = {FP32_WEIGHT_KEY: flat_groups[g], **_group_moments(outer.get(OPTIMIZER_STATE_DICT), g)}
        meta = partitions[g] if g < len(partitions) else {}
        count, rank = int(meta.get("partition_count", dp_degree)), int(meta.get("partition_rank", dp_rank))
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            per_rank = math.ceil(numel / count)
            keep = max(0, min(per_rank, numel - rank * per_rank))
            for state, flat in flats.items():
                if offset + keep > flat.numel():
                    raise CheckpointError(
                        f"{optim_file}: {state} of sub-group {g} has {flat.numel()} elements, too few for {name} "
                        f"at offset {offset} (+{keep}); the optimizer and model-states files do not match"
                    )
                out.setdefault(name, {})[state] = (rank, flat.reshape(-1).narrow(0, offset, keep))
            offset += per_rank
    return out


def read_zero3_shards(folder: str | Path) -> TpShards:
    """Read a ZeRO-3 tag folder into each tensor-parallel rank's whole shards (restricted unpickler)."""
    folder = Path(folder)
    model_grid = rank_grid(zero3_files(folder, "model_states.pt"))
    optim_grid = rank_grid(zero3_files(folder, "optim_states.pt"))
    if (len(model_grid), len(model_grid[0])) != (len(optim_grid), len(optim_grid[0])):
        raise CheckpointError(
            f"{folder}: the model-states files form a {len(model_grid)} x {len(model_grid[0])} (tp x dp) grid but "
            f"the optimizer files a {len(optim_grid)} x {len(optim_grid[0])} one; files are missing"
        )
    dp_degree = len(optim_grid[0])
    first_model = safe_load(model_grid[0][0])
    shards: list[dict[str, dict[str, torch.Tensor]]] = []
    names: list[str] = []
    for tp_rank, row in enumerate(optim_grid):
        model = first_model if tp_rank == 0 else safe_load(model_grid[tp_rank][0])
        shapes = model.get(PARAM_SHAPES)
        if not isinstance(shapes, list):
            raise CheckpointError(f"{model_grid[tp_rank][0]} has no {PARAM_SHAPES} list: not a ZeRO-3 model file")
        if tp_rank == 0:
            names = [name for group in shapes for name in group]
        collected: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
        for dp_rank, optim_file in enumerate(row):
            for name, states in _pieces_of_rank(optim_file, shapes, dp_rank, dp_degree).items():
                for state, piece in states.items():
                    collected.setdefault(name, {}).setdefault(state, []).append(piece)
        by_shape = {name: tuple(shape) for group in shapes for name, shape in group.items()}
        shards.append(
            {
                name: {
                    state: torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]).reshape(by_shape[name])
                    for state, pieces in states.items()
                }
                for name, states in collected.items()
            }
        )
    return TpShards(
        shards=shards,
        names=names,
        universal_info=dict(first_model.get(UNIVERSAL_CHECKPOINT_INFO) or {}),
        optimizer_state=_optimizer_state(optim_grid[0][0]),
        model_files=[path for row in model_grid for path in row],
    )


def _optimizer_state(first_optimizer_file: Path) -> dict[str, Any]:
    """The first rank's optimizer entries without its partitions (flat fp32 and moments; scalars such as the step
    stay), with the param groups at the top level (where DeepSpeed's universal loader and
    read_universal_checkpoint look)."""
    outer = dict(safe_load(first_optimizer_file)[OPTIMIZER_STATE_DICT])
    outer.pop(FP32_FLAT_GROUPS, None)
    inner = outer.get(OPTIMIZER_STATE_DICT)
    if isinstance(inner, Mapping):
        outer[PARAM_GROUPS] = inner.get(PARAM_GROUPS, [])
        states = inner.get("state")
        entries = enumerate(states) if isinstance(states, list) else (states or {}).items()
        scalars = {key: {k: v for k, v in entry.items() if not _is_partition(v)} for key, entry in entries}
        outer[OPTIMIZER_STATE_DICT] = {
            **inner,
            "state": list(scalars.values()) if isinstance(states, list) else scalars,
        }
    return outer


def _is_partition(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0
