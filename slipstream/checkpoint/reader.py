"""Reading a native checkpoint: whole global tensors, or just the flat range one rank needs.

Owns `CheckpointReader` (manifest + verified files + a cache of open safetensors files) and
`resolve_checkpoint_dir` (save_dir + tag or `latest` -> the tag directory). Resharding is plain arithmetic
on flat ranges: a rank of any world size asks `read_flat_range(key, start, end)` for its shard and gets the
overlapping parts of the stored pieces, reading only those bytes. See [Note: checkpoint tensors].
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.atomic import read_latest
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.manifest import (
    MANIFEST_FILE,
    Manifest,
    Piece,
    TensorEntry,
    check_coverage,
    corrupt_files,
    read_manifest,
    verify_files,
)
from slipstream.checkpoint.safetensors_io import ClosesOnExit, SafetensorsFile


def direct_target(tensor: torch.Tensor, dtype: torch.dtype, numel: int) -> bool:
    """Whether checkpoint bytes of `dtype` can be read straight into `tensor` (`read_flat_range(out=...)`)."""
    return tensor.dtype == dtype and tensor.numel() == numel and tensor.device.type == "cpu" and tensor.is_contiguous()


def resolve_checkpoint_dir(path: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The tag directory to read: `path/<tag>`, `path/<latest>`, or `path` itself when it holds a manifest."""
    path = Path(path)
    if tag is None:
        if (path / MANIFEST_FILE).is_file():
            return path
        tag = read_latest(path)
        if tag is None:
            raise CheckpointError(
                f"{path} has neither {MANIFEST_FILE} nor a `latest` file; pass tag=... (the "
                "name of a checkpoint directory under it) or the checkpoint directory itself"
            )
    ckpt_dir = path / tag
    if not (ckpt_dir / MANIFEST_FILE).is_file():
        tags = sorted(p.name for p in path.glob("*") if (p / MANIFEST_FILE).is_file()) if path.is_dir() else []
        raise CheckpointError(
            f"checkpoint tag {tag!r} not found: {ckpt_dir / MANIFEST_FILE} does not exist. "
            f"Tags with a manifest under {path}: {tags or 'none'}"
        )
    return ckpt_dir


class CheckpointReader(ClosesOnExit):
    """Read-only access to one checkpoint directory (a tag directory holding manifest.json).

    With `verify=True` (the default) every file's size and sha256 is checked against the manifest first, and a
    CheckpointCorrupt names each missing or damaged file. With `verify="lazy"` (what load_checkpoint uses: a
    rank of a large job reads only its own slices) every file's presence and size are checked first and each
    file's sha256 when it is first opened, so a rank hashes only the files it reads. With `verify="stream"` (what
    export uses: its output can be deleted when a check fails) presence and sizes are checked first, each file
    is hashed as it is read, and `verify_read()` completes the hashes of the files read and compares them: every
    byte is read once. Piece coverage is always checked.
    """

    def __init__(self, ckpt_dir: str | os.PathLike[str], *, verify: bool | str = True) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.manifest: Manifest = read_manifest(self.ckpt_dir)
        self._lazy = verify == "lazy"
        self._stream = verify == "stream"
        if self._lazy or self._stream:
            verify_files(self.ckpt_dir, self.manifest, hash_files=False)
        elif verify:
            verify_files(self.ckpt_dir, self.manifest)
        else:
            check_coverage(self.manifest)
        self._files: dict[str, SafetensorsFile] = {}

    @property
    def scalars(self) -> dict[str, Any]:
        return self.manifest.scalars

    @property
    def location(self) -> str:
        """The checkpoint directory, for error messages."""
        return str(self.ckpt_dir)

    def keys(self) -> list[str]:
        return list(self.manifest.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.manifest.tensors

    def entry(self, key: str) -> TensorEntry:
        if key not in self.manifest.tensors:
            close = difflib.get_close_matches(key, self.manifest.tensors, n=3)
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir} has no tensor {key!r}"
                + (f"; did you mean {close}?" if close else f"; it holds {len(self.manifest.tensors)} tensors")
            )
        return self.manifest.tensors[key]

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(global shape, dtype) of tensor `key`, from the manifest alone."""
        entry = self.entry(key)
        return entry.shape, entry.torch_dtype

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            if self._lazy:
                verify_files(self.ckpt_dir, self.manifest, files={name})
            self._files[name] = SafetensorsFile(self.ckpt_dir / name, hash_reads=self._stream)
        return self._files[name]

    def verify_read(self) -> None:
        """With verify="stream": check the sha256 of every file read so far against the manifest (reading only
        what no read covered); raises CheckpointCorrupt naming each file that differs."""
        if not self._stream:
            raise CheckpointError('verify_read() needs CheckpointReader(..., verify="stream")')
        problems = []
        for name, handle in self._files.items():
            digest, recorded = handle.read_digest(), self.manifest.files[name].get("sha256")
            if digest != recorded:
                problems.append(f"{name}: sha256 is {digest}, the manifest says {recorded}")
        if problems:
            raise corrupt_files(self.ckpt_dir, problems)

    def _read_piece_range(
        self, key: str, entry: TensorEntry, piece: Piece, start: int, end: int, out: torch.Tensor
    ) -> None:
        """Global elements [start, end) (inside `piece`) into `out`."""
        handle = self._file(piece.file)
        dtype, shape = handle.info(piece.name)
        stored = 1
        for dim in shape:
            stored *= dim
        if stored != piece.end - piece.start or dtype != entry.torch_dtype:
            raise CheckpointError(
                f"{key}: piece {piece.name!r} in {handle.path} is {dtype} with {stored} elements, "
                f"but the manifest says {entry.dtype} [{piece.start}, {piece.end}); the "
                "checkpoint is inconsistent"
            )
        handle.get_flat_range(piece.name, start - piece.start, end - piece.start, out=out)

    def read_flat_range(self, key: str, start: int, end: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened global tensor `key`, reading only the overlapping pieces.

        With `out` (a contiguous CPU tensor of the stored dtype and `end - start` elements, e.g. the engine's own
        shard) the bytes land there directly, with no intermediate tensor, and `out` (flattened) is returned.
        """
        entry = self.entry(key)
        if not 0 <= start <= end <= entry.numel:
            raise CheckpointError(
                f"range [{start}, {end}) is outside {key!r}, which has {entry.numel} elements "
                f"(shape {list(entry.shape)})"
            )
        if out is None:
            out = torch.empty(end - start, dtype=entry.torch_dtype)
        elif not direct_target(out, entry.torch_dtype, end - start):
            raise CheckpointError(
                f"{key}: `out` must be a contiguous CPU {entry.torch_dtype} tensor of {end - start} elements, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
            )
        out = out.view(-1)
        for piece in entry.pieces:
            low, high = max(start, piece.start), min(end, piece.end)
            if low < high:
                self._read_piece_range(key, entry, piece, low, high, out[low - start : high - start])
        return out

    def read(self, key: str) -> torch.Tensor:
        """The whole global tensor `key`, assembled from its pieces."""
        entry = self.entry(key)
        return self.read_flat_range(key, 0, entry.numel).reshape(entry.shape)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
