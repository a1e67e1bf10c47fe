"""Test helper: write a small native checkpoint the way the engine does (pieces spread over several files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.manifest import (FORMAT_VERSION, Manifest, Piece, TensorEntry, dtype_name,
                                            write_manifest)
from slipstream.checkpoint.safetensors_io import SafetensorsWriter


def write_checkpoint(ckpt_dir: Path, tensors: dict[str, torch.Tensor], *, num_files: int = 2, tag: str = "t",
                     frozen: tuple[str, ...] = (), scalars: dict[str, Any] | None = None) -> Manifest:
    """Split each tensor's flat range evenly over `num_files` files, as `num_files` ranks would store it."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    pieces: dict[str, list[Piece]] = {key: [] for key in tensors}
    files: dict[str, dict[str, Any]] = {}
    for rank in range(num_files):
        file_name = f"rank{rank:03d}.safetensors"
        chunks = {}
        for key, tensor in tensors.items():
            numel = tensor.numel()
            per_rank = -(-numel // num_files)
            start, end = min(rank * per_rank, numel), min((rank + 1) * per_rank, numel)
            if end > start or (numel == 0 and rank == 0):
                chunks[key] = tensor.reshape(-1)[start:end]
                pieces[key].append(Piece(file=file_name, name=key, start=start, end=end))
        entries = [(key, chunk.dtype, tuple(chunk.shape)) for key, chunk in chunks.items()]
        with SafetensorsWriter(ckpt_dir / file_name, entries) as writer:
            for key, chunk in chunks.items():
                writer.write(key, chunk)
        files[file_name] = {"sha256": writer.close(), "bytes": writer.bytes_written}
    manifest = Manifest(
        format_version=FORMAT_VERSION, slipstream_version="test", tag=tag, world_size=num_files, zero_stage=3,
        files=files, scalars=dict(scalars or {}),
        tensors={key: TensorEntry(shape=tuple(t.shape), dtype=dtype_name(t.dtype), pieces=pieces[key],
                                  frozen=key in frozen) for key, t in tensors.items()})
    write_manifest(ckpt_dir, manifest)
    return manifest
