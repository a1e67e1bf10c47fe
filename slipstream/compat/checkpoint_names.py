"""DeepSpeed's checkpoint file names (`deepspeed.checkpoint.utils`, `deepspeed.utils.zero_to_fp32`).

Pure path helpers for code that handles DeepSpeed-format checkpoint directories (the ones
checkpoint/deepspeed/reader.py reads). Slipstream's own checkpoints are a manifest and safetensors files
(docs/checkpoints.md), so a name built here points into a DeepSpeed checkpoint, never into one of ours.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_model_state_files",
    "get_optim_files",
    "get_zero_ckpt_name_for_rank",
]


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike[str], mp_rank_str: str) -> str:
    """`<base_folder>/mp_rank_<mp_rank_str>_model_states.pt` (mp_rank_str as given: '00')."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str | os.PathLike[str], dp_rank: int, mp_rank: int) -> str:
    """`<base_folder>/zero_pp_rank_<dp_rank>_mp_rank_<mp_rank:02d>_optim_states.pt`."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def get_layer_ckpt_name_for_rank(base_folder: str | os.PathLike[str], layer_id: str, tp_rank: int) -> str:
    """`<base_folder>/<layer_id>-model_<tp_rank:02d>_model_states.pt` (a pipeline layer's file)."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}_model_states.pt")


def _natural_key(path: str) -> list[int | str]:
    """Digits compare as numbers: rank 2's file sorts before rank 10's."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _files(checkpoint_dir: str | os.PathLike[str], suffix: str) -> list[str]:
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory; pass a DeepSpeed checkpoint's tag directory")
    found = sorted((str(directory / p.name) for p in directory.glob(f"*{suffix}")), key=_natural_key)
    if not found:
        raise FileNotFoundError(
            f"no *{suffix} file in {directory}: not a DeepSpeed checkpoint tag directory (a Slipstream "
            "checkpoint has manifest.json and safetensors files instead; see docs/checkpoints.md)"
        )
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The `*_optim_states.pt` files of a DeepSpeed tag directory, in rank order (numbers compared as numbers)."""
    return _files(checkpoint_dir, "_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The `*_model_states.pt` files of a DeepSpeed tag directory, in rank order."""
    return _files(checkpoint_dir, "_model_states.pt")
