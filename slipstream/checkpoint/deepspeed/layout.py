"""Where each rank's files sit in a DeepSpeed-format checkpoint folder, and how they regroup at other degrees.

Owns `ParallelDegrees` (DeepSpeed's `model_3d_desc`: pipeline x tensor x data degrees), `RankMap2D` (its
`meg_2d_parallel_map`: (pp index, tp index) -> source file indices), `reshape_2d`, the file discovery of a tag
folder, and `degrees_from_metadata` / `get_model_3d_descriptor`, which read the degrees a folder was saved at.

The numbering is DeepSpeed's: model-state file i of a pp x tp layout belongs to pipeline stage i // tp and
tensor rank i % tp (pp-major), and ZeRO file j to data-parallel rank j // (pp * tp) of model-parallel rank
j % (pp * tp). Shrinking a degree gives each new rank a contiguous run of the old ranks' files, tensor
parallelism first, then pipeline, then data parallelism; growing one is not possible (one file cannot be
split without knowing what it holds).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from slipstream.checkpoint.deepspeed.constants import (
    BF16_ZERO_FILE_PREFIX,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    FP16_ZERO_FILE_PREFIX,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    ZERO_FILE_PREFIX,
)
from slipstream.checkpoint.errors import CheckpointError, ConversionMetadataError

__all__ = [
    "ParallelDegrees",
    "RankMap2D",
    "degrees_from_metadata",
    "files_with_prefix",
    "folder_files",
    "get_model_3d_descriptor",
    "parallel_dimensions_record",
    "reshape_2d",
    "shapes_per_tp_rank",
    "split_evenly",
    "zero_files",
]


def split_evenly(items: Sequence[int], parts: int) -> list[list[int]]:
    """`items` cut into `parts` contiguous runs of equal length."""
    if parts < 1 or len(items) % parts:
        raise ValueError(
            f"cannot split {len(items)} checkpoint files {list(items)} into {parts} equal groups: the old degree "
            "must be a multiple of the new one"
        )
    size = len(items) // parts
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


class RankMap2D:
    """(pipeline index, tensor index) -> the source file indices that rank reads, in order."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def identity(cls, pp_degree: int, tp_degree: int) -> RankMap2D:
        """Every rank reads its own file: index i is stage i // tp, tensor rank i % tp."""
        ranks = cls(pp_degree, tp_degree)
        for i in range(pp_degree * tp_degree):
            ranks.map[(i // tp_degree, i % tp_degree)] = [i]
        return ranks

    def simple_init(self) -> None:
        """DeepSpeed's name for filling the map as `identity` does."""
        self.map = RankMap2D.identity(self.pp_degree, self.tp_degree).map

    def _check(self, pp_index: int | None, tp_index: int | None) -> None:
        for index, degree, axis in ((pp_index, self.pp_degree, "pp_index"), (tp_index, self.tp_degree, "tp_index")):
            if index is not None and not 0 <= index < degree:
                raise IndexError(f"{axis}={index} is outside this map's degree {degree}")

    def add_data(self, pp_index: int, tp_index: int, data: list[int]) -> None:
        self._check(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"add_data expects a list of file indices, got {type(data).__name__}")
        self.map.setdefault((pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The file indices of one rank; None for an index takes every value of that axis (pp-major)."""
        self._check(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [index for p in pps for t in tps for index in self.map.get((p, t), [])]

    def print_data(self, tag: str) -> None:
        print(tag)
        for (p, t), value in sorted(self.map.items()):
            print(f"{p},{t} = {value}")

    def __repr__(self) -> str:
        return f"RankMap2D(pp={self.pp_degree}, tp={self.tp_degree}, {dict(sorted(self.map.items()))})"


def reshape_2d(
    old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int, verbose: bool = False
) -> RankMap2D:
    """The map of a pp x tp layout shrunk to new pp x new tp (DeepSpeed's `reshape_meg_2d_parallel`)."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise ValueError(
            f"cannot grow a checkpoint layout from pp={old_pp_degree}, tp={old_tp_degree} to pp={new_pp_degree}, "
            f"tp={new_tp_degree}: one saved file cannot be split"
        )
    current = RankMap2D.identity(old_pp_degree, old_tp_degree)
    if new_tp_degree != old_tp_degree:
        merged = RankMap2D(old_pp_degree, new_tp_degree)
        for p in range(old_pp_degree):
            for t, run in enumerate(split_evenly(current.get_data(pp_index=p), new_tp_degree)):
                merged.add_data(p, t, run)
        current = merged
    if new_pp_degree != old_pp_degree:
        merged = RankMap2D(new_pp_degree, current.tp_degree)
        for t in range(current.tp_degree):
            for p, run in enumerate(split_evenly(current.get_data(tp_index=t), new_pp_degree)):
                merged.add_data(p, t, run)
        current = merged
    if verbose:
        current.print_data("reshaped pp x tp map:")
    return current


class ParallelDegrees:
    """The pipeline, tensor and data-parallel degrees of a checkpoint (DeepSpeed's `model_3d_desc`)."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def get_desc(self) -> str:
        return f"PP,TP,DP = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        errors = [
            f"{axis} index {index} >= degree {degree}"
            for index, degree, axis in (
                (pp_index, self.pp_degree, "PP"),
                (tp_index, self.tp_degree, "TP"),
                (dp_index, self.dp_degree, "DP"),
            )
            if index >= degree
        ]
        return not errors, errors

    def can_reshape(self, target: ParallelDegrees) -> tuple[bool, list[str]]:
        """(True, []) when every degree of `target` is at most this one's, else (False, what grows)."""
        errors = [
            f"{axis}: {mine} -> {theirs} would grow the degree; only shrinking is possible"
            for axis, mine, theirs in (
                ("PP", self.pp_degree, target.pp_degree),
                ("TP", self.tp_degree, target.tp_degree),
                ("DP", self.dp_degree, target.dp_degree),
            )
            if theirs > mine
        ]
        return not errors, errors

    def reshape(self, target: ParallelDegrees, verbose: bool = False) -> list[RankMap2D]:
        """One map per target data-parallel rank: (pp, tp) -> the source ZeRO file indices it reads."""
        ok, errors = self.can_reshape(target)
        if not ok:
            raise ValueError(f"cannot reshape {self.get_desc()} to {target.get_desc()}: {'; '.join(errors)}")
        model_map = reshape_2d(self.pp_degree, self.tp_degree, target.pp_degree, target.tp_degree, verbose)
        per_model_rank = self.pp_degree * self.tp_degree
        out = [RankMap2D(target.pp_degree, target.tp_degree) for _ in range(target.dp_degree)]
        for p in range(target.pp_degree):
            for t in range(target.tp_degree):
                every_dp = [i + d * per_model_rank for i in model_map.get_data(p, t) for d in range(self.dp_degree)]
                for dp_map, run in zip(out, split_evenly(every_dp, target.dp_degree)):
                    dp_map.add_data(p, t, run)
        return out

    def __repr__(self) -> str:
        return f"ParallelDegrees(pp_degree={self.pp_degree}, tp_degree={self.tp_degree}, dp_degree={self.dp_degree})"


def folder_files(folder: str | os.PathLike[str]) -> list[str]:
    """Every file below `folder` (DeepSpeed's checkpoint readers look recursively)."""
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]


def files_with_prefix(files: Iterable[str], prefix: str) -> list[str]:
    return sorted(f for f in files if os.path.basename(f).startswith(prefix))


def zero_files(folder: str | os.PathLike[str]) -> list[str]:
    """The folder's ZeRO optimizer files, ordered by (data-parallel rank, model-parallel rank)."""
    files = folder_files(folder)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = files_with_prefix(files, prefix)
        if found:
            pattern = re.compile(rf"{re.escape(prefix)}(\d+)_{MODEL_FILE_PREFIX}(\d+)")
            keyed = []
            for name in found:
                match = pattern.search(os.path.basename(name))
                if match is None:
                    raise CheckpointError(
                        f"{name}: cannot read the data- and model-parallel ranks from the file name (expected "
                        f"{prefix}<dp>_{MODEL_FILE_PREFIX}<mp>...); rename or remove the file"
                    )
                keyed.append((int(match.group(1)), int(match.group(2)), name))
            return [name for _, _, name in sorted(keyed)]
    return []


def _positive(value: object, key: str, file: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{file}: {CHECKPOINT_PARALLEL_DIMS}[{key!r}] must be a positive integer, got {value!r}")
    return value


def degrees_from_metadata(
    files: Sequence[str], zero: Sequence[str], metadata: Sequence[tuple[str, Mapping[str, object]]]
) -> ParallelDegrees:
    """The degrees of a folder from its model-state files' recorded `checkpoint_parallel_dimensions` (all or
    none must record them, and alike), or, for older writers, from the file counts."""
    recorded: list[tuple[int, int]] = []
    missing: list[str] = []
    for file, meta in metadata:
        dims = meta.get(CHECKPOINT_PARALLEL_DIMS)
        if dims is None:
            missing.append(file)
            continue
        if not isinstance(dims, Mapping):
            raise CheckpointError(f"{file}: {CHECKPOINT_PARALLEL_DIMS} must be a dict, got {type(dims).__name__}")
        recorded.append(
            (
                _positive(dims.get(CHECKPOINT_PP_DEGREE), CHECKPOINT_PP_DEGREE, file),
                _positive(dims.get(CHECKPOINT_TP_DEGREE), CHECKPOINT_TP_DEGREE, file),
            )
        )
    num_model = len(metadata)
    if recorded:
        if missing:
            raise CheckpointError(
                f"{CHECKPOINT_PARALLEL_DIMS} is missing from model-state files {missing} while others record it: "
                "the folder mixes files of two writers; copy one checkpoint's files only"
            )
        if len(set(recorded)) != 1:
            raise CheckpointError(
                f"{CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {recorded} (pp, tp); the folder "
                "mixes files of two checkpoints"
            )
        pp, tp = recorded[0]
        if num_model != pp * tp:
            raise CheckpointError(
                f"the folder has {num_model} model-state files but records pp_degree={pp} x tp_degree={tp}; "
                "files are missing or left over from another save"
            )
        if len(zero) % (pp * tp):
            raise CheckpointError(
                f"the folder has {len(zero)} ZeRO files, not a multiple of pp_degree={pp} x tp_degree={tp}; "
                "a rank's optimizer file is missing"
            )
        return ParallelDegrees(pp, tp, max(1, len(zero) // (pp * tp)))
    stage_one_layers = len(files_with_prefix(files, f"{LAYER_FILE_PREFIX}01"))
    if stage_one_layers:
        tp = stage_one_layers
        pp = max(1, num_model // tp)
    else:
        tp, pp = max(1, num_model), 1
    return ParallelDegrees(pp, tp, max(1, len(zero) // (pp * tp)))


def get_model_3d_descriptor(folder: str | os.PathLike[str]) -> ParallelDegrees:
    """The degrees a DeepSpeed tag folder was saved at (reads each model-state file once, restricted unpickler)."""
    from slipstream.checkpoint.deepspeed.safe_pickle import safe_load

    files = folder_files(folder)
    metadata = []
    for file in files_with_prefix(files, MODEL_FILE_PREFIX):
        state = safe_load(file)
        metadata.append((file, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS)}))
    return degrees_from_metadata(files, zero_files(folder), metadata)


def parallel_dimensions_record(mpu: object) -> dict[str, dict[str, int]]:
    """What a DeepSpeed writer stores in every model-state file about its layout (`_checkpoint_parallel_metadata`):
    the pipeline and tensor degrees of `mpu` (1 and 1 without one), read through whichever getter names it has
    (Megatron's or DeepSpeed's topology's)."""
    pp = tp = 1
    if mpu is not None:
        for getter in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"):
            if hasattr(mpu, getter):
                pp = int(getattr(mpu, getter)())
                break
        for getter in (
            "get_tensor_model_parallel_world_size",
            "get_slice_parallel_world_size",
            "get_model_parallel_world_size",
        ):
            if hasattr(mpu, getter):
                tp = int(getattr(mpu, getter)())
                break
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}


def shapes_per_tp_rank(
    slice_shapes_by_tp: Sequence[Mapping[str, object]], pp_degree: int, tp_degree: int
) -> dict[str, list[Any]]:
    """Per parameter, its shape on each tensor rank (None where a rank has none), from the model-state files'
    shapes in pp-major order (file pp * tp_degree + tp); a parameter present in several pipeline stages (tied)
    must have one shape (DeepSpeed's `_group_per_tp_shapes`)."""
    per_tp: list[dict[str, Any]] = []
    for tp in range(tp_degree):
        shapes: dict[str, Any] = {}
        for pp in range(pp_degree):
            for name, shape in slice_shapes_by_tp[pp * tp_degree + tp].items():
                if name in shapes and shapes[name] != shape:
                    raise ConversionMetadataError(
                        f"pipeline replicas of {name} on tensor rank {tp} disagree on shape: {shapes[name]} vs "
                        f"{shape}; the tied parameter was partitioned inconsistently"
                    )
                shapes[name] = shape
        per_tp.append(shapes)
    names = {name for shapes in per_tp for name in shapes}
    return {name: [shapes.get(name) for shapes in per_tp] for name in names}
