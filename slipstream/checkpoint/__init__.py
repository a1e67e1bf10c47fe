"""Checkpoints: Slipstream's own format (save, load at any layout, verify, export); DeepSpeed's format is in
`deepspeed/` (its folders read, universal checkpoints read and written, sharded folders converted).

The native format is a directory per tag holding safetensors files and a JSON manifest (no pickle):
`safetensors_io` (bytes on disk), `manifest` (what each tensor is and which file holds which slice),
`atomic` (crash-safe commit, `latest`), `reader` (read whole tensors or one rank's flat range), `export`
(Hugging Face-style safetensors, streaming). `errors` holds the exception classes of both formats.
"""

from __future__ import annotations

from typing import Any

from slipstream.checkpoint.atomic import (
    commit_dir,
    make_tmp_dir,
    read_latest,
    recover,
    tmp_dir_for,
    write_latest,
    write_text_atomic,
)
from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError
from slipstream.checkpoint.export import export_checkpoint, parse_size
from slipstream.checkpoint.manifest import (
    FORMAT_VERSION,
    Manifest,
    Piece,
    TensorEntry,
    dtype_name,
    parse_dtype,
    read_manifest,
    verify_files,
    write_manifest,
)
from slipstream.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir
from slipstream.checkpoint.safetensors_io import SafetensorsFile, SafetensorsWriter, save_file, sha256_file

__all__ = [
    "FORMAT_VERSION",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointReader",
    "Manifest",
    "Piece",
    "SafetensorsFile",
    "SafetensorsWriter",
    "TensorEntry",
    "commit_dir",
    "dtype_name",
    "export_checkpoint",
    "make_tmp_dir",
    "parse_dtype",
    "parse_size",
    "read_latest",
    "read_manifest",
    "recover",
    "resolve_checkpoint_dir",
    "save_file",
    "sha256_file",
    "tmp_dir_for",
    "verify_files",
    "write_latest",
    "write_manifest",
    "write_text_atomic",
]


def __getattr__(name: str) -> Any:
    """DeepSpeed's `deepspeed.checkpoint` names (its folder descriptor, reshape maps, key constants), declared in
    compat/aliases.py's COMPOSITES."""
    import importlib

    return importlib.import_module("slipstream.compat.aliases").composite_attribute(__name__, name)
