"""The metadata checks of DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`) over a DeepSpeed
ZeRO-1/2 folder's model-state metadata (checkpoint/deepspeed/folder.py's `model_state_metadata`).

Owns `_aggregate_autoep_zero12_metadata`, `_inject_missing_state` and `_check_for_required_state`. Each check
raises a `CheckpointError` (a RuntimeError) naming the file and what is malformed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slipstream.checkpoint.deepspeed.constants import (
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_LAYERS_KEY,
    PARAM_SHAPES,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from slipstream.checkpoint.deepspeed.folder import DATA_BEFORE_EXPERT
from slipstream.checkpoint.deepspeed.tp_shards import check_conversion_support
from slipstream.checkpoint.errors import CheckpointError

__all__ = ["_aggregate_autoep_zero12_metadata", "_check_for_required_state", "_inject_missing_state"]


def _aggregate_autoep_zero12_metadata(
    model_state_metadata: Sequence[tuple[str, dict[str, Any]]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
    """(per-file parameter shapes, the AutoEP layer entries merged over files by expert prefix or None, the
    data-before-expert-parallelism flag), refusing malformed or conflicting metadata."""
    shapes_by_file: list[dict[str, Any]] = []
    layers: dict[str, dict[str, Any]] = {}
    layer_source: dict[str, str] = {}
    orderings: dict[str, bool] = {}
    for file, meta in model_state_metadata:
        shapes = meta[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise CheckpointError(f"{file}: {PARAM_SHAPES} must hold dictionaries of parameter shapes, got {shapes!r}")
        shapes_by_file.append(shapes)
        autoep = meta[AUTOEP_LAYERS_KEY]
        if autoep is not None:
            if not isinstance(autoep, list):
                raise CheckpointError(f"{file}: AutoEP metadata must be a list of layer dicts, got {autoep!r}")
            for entry in autoep:
                if not isinstance(entry, dict):
                    raise CheckpointError(f"{file}: AutoEP layer metadata must contain dictionaries, got {entry!r}")
                prefix = entry.get(AUTOEP_EXPERT_KEY_PREFIX)
                if not isinstance(prefix, str) or not prefix:
                    raise CheckpointError(
                        f"{file}: AutoEP {AUTOEP_EXPERT_KEY_PREFIX} must be a non-empty string, got {prefix!r}"
                    )
                if prefix in layers and layers[prefix] != entry:
                    raise CheckpointError(
                        f"conflicting AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} {prefix!r} in "
                        f"{layer_source[prefix]} and {file}"
                    )
                layers.setdefault(prefix, entry)
                layer_source.setdefault(prefix, file)
        config = meta["ds_config"]
        if not isinstance(config, dict):
            raise CheckpointError(f"{file}: ds_config must be a dictionary, got {config!r}")
        ordering = config.get(DATA_BEFORE_EXPERT, False)
        if not isinstance(ordering, bool):
            raise CheckpointError(f"{file}: {DATA_BEFORE_EXPERT} must be a boolean, got {ordering!r}")
        orderings[file] = ordering
    if len(set(orderings.values())) != 1:
        raise CheckpointError(f"{DATA_BEFORE_EXPERT} disagrees across model-state files: {orderings}")
    return shapes_by_file, list(layers.values()) or None, next(iter(orderings.values()))


def _inject_missing_state(ds_checkpoint: Any) -> None:
    """Give a folder without `universal_checkpoint_info` an empty one of the current version."""
    if ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
        }


def _check_for_required_state(ds_checkpoint: Any) -> None:
    info = ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
    if info is None:
        raise CheckpointError(
            f"the checkpoint's model-state files hold no {UNIVERSAL_CHECKPOINT_INFO}; the training script must "
            "record it, or pass --inject_missing_state"
        )
    check_conversion_support(info)
