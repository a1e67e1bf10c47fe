"""DeepSpeed ZeRO-3 checkpoint folders (AutoTP tensor parallelism included) -> the universal layout, written as
DeepSpeed's converter writes it so that either side loads the result.

Owns `convert_zero3_folder`. Without tensor parallelism each `zero/<name>/<state>.pt` is the bare flat fp32
tensor (DeepSpeed's stage-3 form; `param_shapes` in the copied model-states files gives the shape). With it,
each rank's shard comes from zero3_grid.py and the shards are merged by the checkpoint's
`universal_checkpoint_info` (tp_merge.py) into `{"param": whole tensor, "cat_dim": ...}`. The first optimizer
file's non-partitioned entries go to `zero/optimizer_state.pt`, the model-states files are copied unchanged.
No temporary folder of fragments is written: every rank's shards are read into memory (about 12 bytes per
parameter), then merged one parameter at a time.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.ds_constants import (
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
    FP32_FLAT_GROUPS,
    FP32_WEIGHT_KEY,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
)
from slipstream.checkpoint.errors import CheckpointError, ConversionMetadataError
from slipstream.checkpoint.safe_pickle import DeepSpeedStub, safe_load
from slipstream.checkpoint.tp_merge import MergeRules, merge_slices
from slipstream.checkpoint.zero3_grid import MOMENTS, read_tp_shards

__all__ = ["check_conversion_support", "convert_zero3_folder", "write_optimizer_state"]


def check_conversion_support(info: Mapping[str, Any] | None) -> None:
    """Refuse a checkpoint whose writer declared parameters it cannot describe (fused layouts it cut its own way)."""
    unsupported = (info or {}).get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        details = ", ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
        raise ValueError(
            f"this AutoTP checkpoint cannot be converted to a universal checkpoint; its writer declared these "
            f"parameters' layouts unsupported: {details}. Load it at its own tensor-parallel size instead"
        )


_DROP = object()


def _plain(value: Any) -> Any:
    """`value` as plain data, so the file loads without DeepSpeed's classes: a DeepSpeed enum as its value, any
    other DeepSpeed object (the loss scaler) left out, so a loading engine keeps its own."""
    if isinstance(value, DeepSpeedStub):
        return value.value if value.args else _DROP
    if isinstance(value, Mapping):
        items = ((k, _plain(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not _DROP}
    if isinstance(value, (list, tuple)):
        return type(value)(v for v in map(_plain, value) if v is not _DROP)
    return value


def _is_partition(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def write_optimizer_state(first_optimizer_file: Path, zero_dir: Path) -> None:
    """`zero/optimizer_state.pt`: the first rank's optimizer entries without its partitions (flat fp32 and
    moments; scalars such as the step stay), with the param groups at the top level (where DeepSpeed's universal
    loader and read_universal_checkpoint look), as plain data (`_plain`)."""
    loaded = safe_load(first_optimizer_file)
    outer = dict(loaded[OPTIMIZER_STATE_DICT])
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
    zero_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_plain(outer), zero_dir / "optimizer_state.pt")


def convert_zero3_folder(source: str | Path, out: str | Path, *, strict: bool = True) -> dict[str, int]:
    """Write the universal checkpoint of the ZeRO-3 tag folder `source` into `out`; returns the degrees read."""
    source, out = Path(source), Path(out)
    grid = read_tp_shards(source)
    zero = out / "zero"
    rules = MergeRules.from_info(grid.universal_info)
    if grid.tp_degree > 1:
        check_conversion_support(grid.universal_info)
    for name in grid.names:
        folder = zero / name
        folder.mkdir(parents=True, exist_ok=True)
        states = [FP32_WEIGHT_KEY, *(m for m in MOMENTS if m in grid.shards[0][name])]
        for state in states:
            if grid.tp_degree == 1:
                torch.save(grid.shards[0][name][state].reshape(-1).clone(), folder / f"{state}.pt")
                continue
            missing = [tp for tp, shard in enumerate(grid.shards) if state not in shard.get(name, {})]
            if missing:
                raise CheckpointError(
                    f"{source}: tensor-parallel ranks {missing} hold no {state} of {name}; the checkpoint is "
                    "incomplete or mixes two saves"
                )
            slices = [shard[name][state] for shard in grid.shards]
            torch.save(merge_slices(name, slices, rules), folder / f"{state}.pt")
    unused = sorted(rules.unused()) if grid.tp_degree > 1 else []
    if unused and strict:
        raise ConversionMetadataError(
            f"{source}: patterns {unused} of universal_checkpoint_info matched no parameter ({grid.names}); "
            "the metadata belongs to another model. Pass --no_strict to convert anyway"
        )
    if unused:
        print(f"ds_to_universal: warning: patterns {unused} matched no parameter")
    write_optimizer_state(grid.first_optimizer_file, zero)
    for file in grid.model_files:
        shutil.copy2(file, out / file.name)
    return {"tp_degree": grid.tp_degree, "dp_degree": grid.dp_degree, "parameters": len(grid.names)}
