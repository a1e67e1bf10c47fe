"""Weights for `init_inference(checkpoint=...)`, read one tensor at a time into the model's parameters.

Two kinds of folder: a Slipstream checkpoint (a tag folder with `manifest.json`, or a save_dir with `latest`:
its `module/` tensors, read whole from their pieces) and a Hugging Face folder of safetensors files (`model.
safetensors`, or the shards named by `model.safetensors.index.json`), opened one file at a time. Each tensor is
copied into the parameter (or buffer) of the same name, in that tensor's dtype, before the model is cast and
split: the extra memory is one tensor. Every parameter must be found (a tied one through its twin); names the
model does not have are reported once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from slipstream.checkpoint.atomic import read_latest
from slipstream.checkpoint.export import MODULE_PREFIX
from slipstream.checkpoint.manifest import MANIFEST_FILE
from slipstream.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir
from slipstream.checkpoint.safetensors_io import SafetensorsFile
from slipstream.utils.logging import warn_once

_HF_INDEX = "model.safetensors.index.json"


def _slipstream_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with CheckpointReader(resolve_checkpoint_dir(folder)) as reader:
        for key in reader.keys():
            if key.startswith(MODULE_PREFIX):
                yield key[len(MODULE_PREFIX) :], reader.read(key)


def _hf_files(folder: Path) -> list[Path]:
    index = folder / _HF_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def _hf_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with SafetensorsFile(path) as shard:
            for key in shard.keys():
                yield key, shard.get(key)


def checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, value) of every tensor of the folder `path`, one at a time (see the module doc)."""
    folder = Path(path)
    if (folder / MANIFEST_FILE).is_file() or (folder.is_dir() and read_latest(folder) is not None):
        return _slipstream_tensors(folder)
    files = _hf_files(folder) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"init_inference(checkpoint={path!r}): not a Slipstream checkpoint ({MANIFEST_FILE} or `latest`) nor a "
            "folder of safetensors files; give the folder save_checkpoint() or save_pretrained() wrote"
        )
    return _hf_tensors(files)


def load_checkpoint_into(model: nn.Module, path: str) -> int:
    """Copy the tensors of `path` into `model` by name; returns how many were copied. Raises when a parameter
    is missing from the checkpoint or a shape differs."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(model.named_buffers())
    loaded: set[str] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for name, value in checkpoint_tensors(path):
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(
                    f"init_inference(checkpoint={path!r}): '{name}' has shape {tuple(value.shape)} there and "
                    f"{tuple(target.shape)} in the model; build the model with the checkpoint's configuration"
                )
            target.copy_(value)
            loaded.add(name)
    found = {id(targets[n]) for n in loaded}
    missing = [n for n, p in model.named_parameters() if id(p) not in found]
    if missing:
        raise ValueError(
            f"init_inference(checkpoint={path!r}): {len(missing)} parameter(s) not in the checkpoint, e.g. "
            f"{missing[:5]}; give the checkpoint of this model"
        )
    if unknown:
        warn_once(f"inference-unknown:{path}", f"slipstream: init_inference ignored checkpoint tensors {unknown[:5]}")
    return len(loaded)
