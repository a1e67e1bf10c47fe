"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions, reading Slipstream's native checkpoints.

Owns the DeepSpeed names and signatures and the `python -m slipstream.utils.zero_to_fp32` command line (that
DeepSpeed path is an alias declared in compat/aliases.py); the reading is checkpoint/reader.py and the writing checkpoint/export.py. Unlike DeepSpeed's script, no
per-rank files are merged here: the manifest already describes every tensor globally, so the fp32 state dict
is read tensor by tensor, and the converter streams one tensor at a time. `get_optim_files` and
`get_model_state_files` list a DeepSpeed checkpoint's per-rank files (compat/checkpoint_names.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from slipstream.checkpoint.export import export_items, parse_size, write_items
from slipstream.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir
from slipstream.compat.checkpoint_names import get_model_state_files, get_optim_files

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
]


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The model's full state dict (floating tensors in fp32) from a checkpoint save_dir or tag directory;
    a tied parameter appears under each of its names (one tensor)."""
    source = resolve_checkpoint_dir(checkpoint_dir, tag)
    state_dict: dict[str, torch.Tensor] = {}
    with CheckpointReader(source) as reader:
        for item in export_items(reader, dtype="fp32", exclude_frozen=exclude_frozen_parameters):
            state_dict[item.name] = reader.read(item.key).to(item.dtype)
        shared = reader.manifest.scalars.get("shared_params") or {}
    for name, owner in shared.items():  # a tied parameter under each of its names, one tensor (as DeepSpeed)
        if owner in state_dict:
            state_dict[name] = state_dict[owner]
    return state_dict


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 model weights under `output_dir`: `pytorch_model.bin` (torch.save of the state dict, DeepSpeed's
    default) or with `safe_serialization` `model.safetensors`; shards + index above `max_shard_size`."""
    limit = parse_size(max_shard_size)
    source = resolve_checkpoint_dir(checkpoint_dir, tag)
    out = Path(output_dir)
    with CheckpointReader(source) as reader:
        items = export_items(reader, dtype="fp32", exclude_frozen=exclude_frozen_parameters)
        out.mkdir(parents=True, exist_ok=True)
        tied = reader.manifest.scalars.get("shared_params") or {}
        write_items(reader, items, out, max_shard_size=limit, progress=True, pickle=not safe_serialization, tied=tied)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Move `model` to CPU and load the checkpoint's fp32 weights into it (strict=False, as DeepSpeed)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.utils.zero_to_fp32",
        description="Write a checkpoint's fp32 model weights (pytorch_model.bin, or safetensors).",
    )
    parser.add_argument("checkpoint_dir", help="the save_dir, or one checkpoint (tag) directory")
    parser.add_argument("output_dir", help="directory for model*.safetensors")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output file (default 5GB)")
    parser.add_argument(
        "--safe_serialization",
        action="store_true",
        help="write model.safetensors instead of pytorch_model.bin",
    )
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the `latest` file)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="skip requires_grad=False params")
    # Every option's dest is the parameter of the same name, so the parsed namespace is the call's arguments.
    convert_zero_checkpoint_to_fp32_state_dict(**vars(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
