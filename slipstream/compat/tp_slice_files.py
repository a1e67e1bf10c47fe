"""DeepSpeed's converter's fragment folder, for callers of `merge_tp_slices` and `_merge_zero_shards`
(`deepspeed.checkpoint.ds_to_universal`).

DeepSpeed's converter first writes every rank's fragment of every state to
`<slice_dir>/<param name>/<tp rank>/<state>.<dp rank, two digits>` (flat tensors; `step` a scalar), then merges
them. Slipstream's own conversion merges in memory (checkpoint/deepspeed/tp_universal.py) and never writes this
folder; these functions read one that DeepSpeed (or a test) wrote, with the restricted unpickler, and apply the
same merge rules (checkpoint/deepspeed/tp_merge.py).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.layout import shapes_per_tp_rank as _group_per_tp_shapes
from slipstream.checkpoint.deepspeed.safe_pickle import safe_load
from slipstream.checkpoint.deepspeed.tp_merge import MergeRules, merge_slices
from slipstream.checkpoint.errors import ConversionMetadataError

__all__ = ["_group_per_tp_shapes", "_merge_zero_shards", "merge_tp_slices"]

_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _rank_fragments(folder: Path, state: str) -> list[Path]:
    """`<state>.<dp>` files of one tensor rank's folder, in data-parallel order."""
    pattern = re.compile(rf"^{re.escape(state)}\.(\d+)$")
    found = []
    for path in folder.glob(f"{state}.*") if folder.is_dir() else []:
        match = pattern.match(path.name)
        if match is None:
            raise ConversionMetadataError(f"{path}: cannot read the data-parallel rank from the fragment's name")
        found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def _merge_zero_shards(
    param_base_path: str, state: str, tp_degree: int, slice_shapes: Sequence[Any] | None = None
) -> list[Any]:
    """Each tensor rank's slice of `state`: its data-parallel fragments concatenated (and shaped as
    `slice_shapes[tp]` when given). A rank that wrote no fragment gets an empty slice in its place when its
    recorded shape is empty, so that later ranks keep their positions; otherwise its absence is an error."""
    base = Path(param_base_path)
    slices: list[Any] = []
    gaps: list[tuple[int, int]] = []
    for tp in range(tp_degree):
        files = _rank_fragments(base / str(tp), state)
        if not files:
            gaps.append((tp, len(slices)))
            continue
        loaded = [safe_load(f) for f in files]
        if state == "step":
            if any(value != loaded[0] for value in loaded[1:]):
                raise ConversionMetadataError(f"{base / str(tp)}: the data-parallel ranks' step values differ")
            slices.append(loaded[0])
            continue
        merged = torch.cat([t.reshape(-1) for t in loaded])
        slices.append(merged if slice_shapes is None else merged.reshape(tuple(slice_shapes[tp])))
    if gaps and slice_shapes is not None and slices and isinstance(slices[0], torch.Tensor):
        for tp, position in reversed(gaps):
            shape = tuple(slice_shapes[tp])
            if math.prod(shape) != 0:
                raise ConversionMetadataError(
                    f"{base}: tensor rank {tp} wrote no {state} fragment, but its recorded shape {shape} is not "
                    "empty; the extraction lost data"
                )
            slices.insert(position, torch.empty(shape, dtype=slices[0].dtype))
    return slices


def merge_tp_slices(
    uc_info: Mapping[str, Any] | None,
    dir: str,
    slice_dir: str,
    tp_degree: int,
    name_and_shapes: tuple[str, Sequence[Any]],
) -> set[str]:
    """Merge one parameter's fragments in `slice_dir` into `<dir>/<name>/{step,fp32,exp_avg,exp_avg_sq}.pt`;
    returns the merge patterns of `uc_info` this parameter did not match."""
    name, shapes = name_and_shapes
    source = os.path.join(slice_dir, name)
    target = Path(dir) / name
    target.mkdir(parents=True, exist_ok=True)
    rules = MergeRules.from_info(uc_info)
    steps = _merge_zero_shards(source, "step", tp_degree, shapes)
    if steps:
        torch.save(steps[0], target / "step.pt")
    for state in _STATES:
        slices = _merge_zero_shards(source, state, tp_degree, shapes)
        if not slices:
            raise ConversionMetadataError(f"{source}: no {state} fragment for any tensor rank")
        torch.save(merge_slices(name, slices, rules), target / f"{state}.pt")
    return rules.unused()
