"""A DeepSpeed-format tag folder described without loading its tensors: DeepSpeed's `DeepSpeedCheckpoint` and
`ZeROCheckpoint` (named `DeepSpeedCheckpointFolder` and `ZeroFiles` here, since `reader`'s
`DeepSpeedCheckpoint` is the global-tensor view of a checkpoint).

`DeepSpeedCheckpointFolder` reads every `mp_rank_*` model-state file once, keeps only the metadata a converter
needs (parallel degrees, parameter shapes, AutoEP layer entries, the data-before-expert ordering flag) and the
first file's global entries (`iteration`, `args`, `checkpoint_info`, `universal_checkpoint_info`), and maps
(pp, tp, dp) ranks to their ZeRO files at the saved degrees or smaller ones (layout.py). Every file goes
through the restricted unpickler. Megatron's per-layer file maps (embedding, transformer, final norm) are not
provided.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.constants import (
    AUTOEP_LAYERS_KEY,
    AUTOEP_LAYERS_KEY_LEGACY,
    AUTOEP_ZERO12_REQUIRED_FIELDS,
    BASE_OPTIMIZER_STATE,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    GROUP_PADDINGS,
    MODEL_FILE_PREFIX,
    OPTIMIZER_STATE_DICT,
    PARAM_SHAPES,
    UNIVERSAL_CHECKPOINT_INFO,
)
from slipstream.checkpoint.deepspeed.layout import (
    ParallelDegrees,
    RankMap2D,
    degrees_from_metadata,
    files_with_prefix,
    folder_files,
    get_model_3d_descriptor,
    reshape_2d,
    zero_files,
)
from slipstream.checkpoint.deepspeed.safe_pickle import safe_load
from slipstream.checkpoint.errors import CheckpointError

__all__ = ["DeepSpeedCheckpointFolder", "ZeroFiles"]

ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"
_AUTOEP_FIELDS = ("moe_layer_id", "module_path", *AUTOEP_ZERO12_REQUIRED_FIELDS)
_LAYER_FILE = re.compile(r"layer_(\d+)-model_.*")


def _require_folder(folder: str) -> None:
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is not a folder; pass a DeepSpeed checkpoint's tag folder (global_stepN)")


def _load_one(files: Sequence[str], what: str) -> dict[str, Any]:
    if len(files) != 1:
        raise NotImplementedError(
            f"{what}: merging the states of {len(files)} saved ranks into one ({list(files)}) is not implemented; "
            "convert the folder with ds_to_universal and load the universal checkpoint at the new degrees instead"
        )
    return dict(safe_load(files[0]))


class ZeroFiles:
    """The ZeRO optimizer files of a tag folder by (pp, tp, dp) rank (DeepSpeed's `ZeROCheckpoint`)."""

    def __init__(self, dir: str, source_3d: ParallelDegrees | None = None) -> None:
        _require_folder(dir)
        self.dir = dir
        self.file_list = zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.file_list:
            raise CheckpointError(f"no ZeRO files (*zero_pp_rank_*) in {dir}: not a DeepSpeed ZeRO checkpoint folder")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = ParallelDegrees(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: ParallelDegrees) -> None:
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        if not 0 <= dp_index < len(self._3d_file_map):
            raise IndexError(f"dp_index {dp_index} is outside the target data-parallel degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(
        self,
        pp_index: int,
        tp_index: int,
        dp_index: int,
        keys_to_ignore: Sequence[str] = (),
        strip_tensor_paddings: bool = True,
    ) -> dict[str, Any]:
        """The optimizer-states file of one rank at the saved degrees, without `keys_to_ignore`; with
        `strip_tensor_paddings`, the flat base-optimizer states lose their group padding."""
        files = self.get_files_for_rank(pp_index, tp_index, dp_index)
        state = _load_one(files, f"ZeroFiles.get_state_for_rank({pp_index}, {tp_index}, {dp_index})")
        for key in keys_to_ignore:
            state.pop(key, None)
        if strip_tensor_paddings:
            _strip_group_paddings(state)
        return state


def _strip_group_paddings(state: dict[str, object]) -> None:
    optimizer = state.get(OPTIMIZER_STATE_DICT)
    if not isinstance(optimizer, dict):
        return
    paddings = optimizer.get(GROUP_PADDINGS)
    groups = (optimizer.get(BASE_OPTIMIZER_STATE) or {}).get("state")
    if not paddings or not groups:
        return
    for key, group in groups.items():
        pad = int(paddings[key])
        if pad:
            for name, value in list(group.items()):
                if name != "step" and isinstance(value, torch.Tensor):
                    group[name] = value.narrow(0, 0, value.numel() - pad).clone()
    optimizer[GROUP_PADDINGS] = [0] * len(paddings)


def _type_name_unless(value: object, kind: type | None) -> Any:
    return value if value is None or (kind is not None and isinstance(value, kind)) else type(value).__name__


def _metadata_of(state: Mapping[str, object]) -> dict[str, Any]:
    """What a converter needs from one model-state file; malformed entries are kept as their type's name so
    that the check that reads them can say what was found."""
    dims = _type_name_unless(state.get(CHECKPOINT_PARALLEL_DIMS), dict)
    if isinstance(dims, dict):
        dims = {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}
    shapes: Any = state.get(PARAM_SHAPES)
    if isinstance(shapes, (list, tuple)) and all(isinstance(group, dict) for group in shapes):
        shapes = {name: shape for group in shapes for name, shape in group.items()}
    else:
        shapes = _type_name_unless(shapes, None)
    autoep = state.get(AUTOEP_LAYERS_KEY)
    if autoep is None:
        autoep = state.get(AUTOEP_LAYERS_KEY_LEGACY)
    if isinstance(autoep, list):
        autoep = [
            {k: entry[k] for k in _AUTOEP_FIELDS if k in entry} if isinstance(entry, dict) else type(entry).__name__
            for entry in autoep
        ]
    else:
        autoep = _type_name_unless(autoep, None)
    config = state.get("ds_config", {})
    if isinstance(config, dict):
        ordering = config.get(DATA_BEFORE_EXPERT, False)
        config = {DATA_BEFORE_EXPERT: ordering if isinstance(ordering, bool) else type(ordering).__name__}
    else:
        config = type(config).__name__
    return {CHECKPOINT_PARALLEL_DIMS: dims, PARAM_SHAPES: shapes, AUTOEP_LAYERS_KEY: autoep, "ds_config": config}


class DeepSpeedCheckpointFolder:
    """A DeepSpeed tag folder's layout and metadata (DeepSpeed's `deepspeed.checkpoint.DeepSpeedCheckpoint`)."""

    def __init__(
        self,
        dir: str,
        tp_degree: int | None = None,
        pp_degree: int | None = None,
        dp_degree: int | None = None,
    ) -> None:
        _require_folder(dir)
        self.dir = dir
        self.file_list = folder_files(dir)
        self.layer_files = sorted(f for f in self.file_list if _LAYER_FILE.fullmatch(os.path.basename(f)))
        self.mp_rank_files = files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        if not self.mp_rank_files:
            raise CheckpointError(
                f"{dir} is not a DeepSpeed checkpoint folder: no {MODEL_FILE_PREFIX}*_model_states.pt file in it"
            )
        self.model_state_metadata, self.global_state = self._discover()
        source = degrees_from_metadata(self.file_list, zero_files(dir), self.model_state_metadata)
        self.zero_checkpoint = ZeroFiles(dir, source_3d=source)
        self.tp_degree = source.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = source.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = source.dp_degree if dp_degree is None else dp_degree
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = RankMap2D.identity(source.pp_degree, source.tp_degree)
        self.new_2d_map = reshape_2d(source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree)
        if (self.pp_degree, self.tp_degree, self.dp_degree) != (source.pp_degree, source.tp_degree, source.dp_degree):
            self.zero_checkpoint.reshape(ParallelDegrees(self.pp_degree, self.tp_degree, self.dp_degree))

    def _discover(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
        metadata = []
        global_state: dict[str, Any] = {}
        for index, file in enumerate(self.mp_rank_files):
            state = safe_load(file)
            metadata.append((file, _metadata_of(state)))
            if index == 0:
                global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                for key in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO):
                    global_state[key] = state.get(key)
            del state
        return metadata, global_state

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def _value(self, key: str) -> Any:
        if key not in self.global_state:  # a key not kept at discovery: one more read of the first file
            self.global_state[key] = safe_load(self.mp_rank_files[0]).get(key)
        return self.global_state[key]

    def get_iteration(self) -> Any:
        return self._value(ITERATION_KEY)

    def get_args(self) -> Any:
        return self._value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        return self._value(info_key)

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return self.zero_checkpoint.get_files_for_rank(pp_index, tp_index, dp_index)

    def get_zero_checkpoint_state(
        self, pp_index: int, tp_index: int, dp_index: int, strip_tensor_paddings: bool = True
    ) -> dict[str, Any]:
        return self.zero_checkpoint.get_state_for_rank(
            pp_index, tp_index, dp_index, keys_to_ignore=[PARAM_SHAPES], strip_tensor_paddings=strip_tensor_paddings
        )

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict[str, Any]:
        files = self.get_2d_parallel_files(tp_index, pp_index)
        return _load_one(files, f"DeepSpeedCheckpointFolder.get_2d_parallel_state({tp_index}, {pp_index})")
