"""DeepSpeed checkpoint folders whose ranks hold tensor-parallel shards (AutoTP or Megatron-style tensor and
pipeline parallelism) -> the universal layout, written as DeepSpeed's converter writes it so that either side
loads the result.

Owns `convert_sharded_folder`. A ZeRO-3 folder (`zero_pp_rank_<dp>_mp_rank_<tp>_*` files, with or without
tensor parallelism) is read by zero3_grid.py, a ZeRO-1/2 folder with `mp_rank_01` or pipeline layer files by
zero12_grid.py; both give each tensor rank's whole shards, which tp_shards.py merges and writes. The
model-states files are copied unchanged. No temporary folder of fragments is written: every rank's shards are
read into memory (about 12 bytes per parameter: fp32 and two moments), then merged one parameter at a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from slipstream.checkpoint.deepspeed.tp_shards import write_tp_shards
from slipstream.checkpoint.deepspeed.zero3_grid import read_zero3_shards, zero3_files
from slipstream.checkpoint.deepspeed.zero12_grid import read_zero12_shards

__all__ = ["convert_sharded_folder", "is_sharded_folder"]


def is_sharded_folder(folder: Path) -> bool:
    """True for a ZeRO-3 folder, or a ZeRO-1/2 one saved with tensor or pipeline parallelism."""
    return bool(zero3_files(folder, "model_states.pt")) or any(
        any(folder.glob(pattern)) for pattern in ("mp_rank_01_model_states.pt", "layer_*-model_*")
    )


def convert_sharded_folder(
    source: str | Path, out: str | Path, *, strict: bool = True, inject_missing_state: bool = False
) -> dict[str, int]:
    """Write the universal checkpoint of the tag folder `source` into `out`; returns what was read.

    A ZeRO-1/2 folder must record `universal_checkpoint_info` (the merge rules; without them a replicated norm
    would be concatenated like a sharded weight), unless `inject_missing_state` accepts the default rules, as
    DeepSpeed's converter does."""
    source, out = Path(source), Path(out)
    zero3 = bool(zero3_files(source, "model_states.pt"))
    if zero3:
        shards = read_zero3_shards(source)
    else:
        shards = read_zero12_shards(source, require_info=not inject_missing_state)
    write_tp_shards(shards, out / "zero", flat_without_tp=zero3, strict=strict, where=source)
    for file in shards.model_files:
        shutil.copy2(file, out / file.name)
    return {"zero_stage": 3 if zero3 else 2, "tp_degree": shards.tp_degree, "parameters": len(shards.names)}
