"""The checkpoint manifest: what each tensor is, which file holds which slice of it, and the scalar state.

Owns `manifest.json` (its dataclasses, JSON form and version), the dtype names used in it, and the checks that
tie a manifest to the files next to it: every listed file present with its size and sha256, and the pieces of
each tensor covering its flat range exactly once.

[Note: checkpoint tensors] A tensor in a checkpoint is GLOBAL: `shape` is the full, unsharded shape, whatever
the world size and ZeRO stage that saved it. Its flattened elements [0, numel) are split into pieces; a piece
names a safetensors file, the key inside that file, and the flat element range [start, end) of the global
tensor it holds (the stored tensor is 1-D or any shape with end - start elements). Keys look like
`module/<param name>`, `optimizer/<param name>/exp_avg` and `client/<key>`. Loading at another world size reads
only the pieces that overlap the flat range it needs (reader.CheckpointReader.read_flat_range).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.atomic import write_text_atomic
from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError
from slipstream.checkpoint.safetensors_io import sha256_file

FORMAT_VERSION = 1
"""The manifest format this Slipstream writes and reads."""
MANIFEST_FILE = "manifest.json"

DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Short dtype names written in manifests; `parse_dtype` also accepts torch's names ("float32", "torch.half")."""
_SHORT_NAMES = {dtype: name for name, dtype in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype ("fp32", "bf16", ...)."""
    if dtype not in _SHORT_NAMES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a checkpoint; supported: {sorted(DTYPE_NAMES)}")
    return _SHORT_NAMES[dtype]


def parse_dtype(name: str) -> torch.dtype:
    """torch dtype for a manifest name ("bf16") or a torch name ("bfloat16", "torch.bfloat16", "half")."""
    if name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    candidate = getattr(torch, name.removeprefix("torch."), None)
    if isinstance(candidate, torch.dtype) and candidate in _SHORT_NAMES:
        return candidate
    raise CheckpointError(
        f"unknown dtype {name!r} in a checkpoint; expected one of {sorted(DTYPE_NAMES)} "
        "or a torch dtype name such as 'float32'"
    )


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored slice of a global tensor. See [Note: checkpoint tensors]."""

    file: str
    """Safetensors file name, relative to the checkpoint directory."""
    name: str
    """Key of the slice inside that file."""
    start: int
    """First flat element of the GLOBAL tensor held by this piece."""
    end: int
    """One past the last flat element held (end - start elements)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A global tensor: its full shape, its dtype name and the pieces that together hold it."""

    shape: tuple[int, ...]
    dtype: str
    """Manifest dtype name ("fp32", "bf16", ...; torch names are accepted too)."""
    pieces: list[Piece]
    frozen: bool = False
    """True for a parameter with requires_grad=False (zero_to_fp32's exclude_frozen_parameters skips it)."""

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a checkpoint directory holds besides tensor bytes, written as `manifest.json`."""

    format_version: int
    slipstream_version: str
    tag: str
    world_size: int
    zero_stage: int
    files: dict[str, dict[str, Any]]
    """File name -> {"sha256": hex digest, "bytes": size}."""
    tensors: dict[str, TensorEntry]
    """Global tensors by key ("module/<name>", "optimizer/<name>/exp_avg", "client/<key>")."""
    scalars: dict[str, Any] = field(default_factory=dict)
    """Plain JSON state: step counters, scheduler state, RNG states as lists, the resolved config, ..."""

    def to_json(self) -> str:
        tensors = {}
        for key, entry in self.tensors.items():
            record: dict[str, Any] = {
                "shape": list(entry.shape),
                "dtype": entry.dtype,
                "pieces": [[p.file, p.name, p.start, p.end] for p in entry.pieces],
            }
            if entry.frozen:
                record["frozen"] = True
            tensors[key] = record
        document = {
            "format_version": self.format_version,
            "slipstream_version": self.slipstream_version,
            "tag": self.tag,
            "world_size": self.world_size,
            "zero_stage": self.zero_stage,
            "files": self.files,
            "tensors": tensors,
            "scalars": self.scalars,
        }
        try:
            return json.dumps(document, indent=1, allow_nan=True)
        except TypeError as exc:
            raise CheckpointError(
                f"manifest of checkpoint {self.tag!r} holds a value JSON cannot store ({exc}); "
                "scalars must be plain JSON (dict, list, str, int, float, bool, None)"
            ) from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> Manifest:
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointCorrupt(f"{source} is not valid JSON ({exc}); the checkpoint is damaged") from None
        if not isinstance(document, dict):
            raise CheckpointCorrupt(f"{source} holds a JSON {type(document).__name__}, expected an object")
        version = document.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format_version {version!r}; this Slipstream reads format_version "
                f"{FORMAT_VERSION}. Use the Slipstream release that wrote it (its manifest says "
                f"slipstream_version={document.get('slipstream_version')!r})."
            )
        try:
            tensors = {key: _entry_from_json(record) for key, record in document["tensors"].items()}
            manifest = cls(
                format_version=version,
                slipstream_version=str(document["slipstream_version"]),
                tag=str(document["tag"]),
                world_size=int(document["world_size"]),
                zero_stage=int(document["zero_stage"]),
                files=dict(document["files"]),
                tensors=tensors,
                scalars=dict(document.get("scalars", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorrupt(
                f"{source} is missing or has a malformed field ({exc!r}); the checkpoint is "
                "damaged or was not written by Slipstream"
            ) from None
        for name, record in manifest.files.items():
            _check_file_name(name, source)
            if (
                not isinstance(record, dict)
                or not isinstance(record.get("sha256"), str)
                or not isinstance(record.get("bytes"), int)
            ):
                raise CheckpointCorrupt(
                    f"{source}: file record {name!r} must be {{'sha256': str, 'bytes': int}}, got {record!r}"
                )
        return manifest


def _entry_from_json(record: dict[str, Any]) -> TensorEntry:
    pieces = [Piece(file=str(f), name=str(n), start=int(s), end=int(e)) for f, n, s, e in record["pieces"]]
    return TensorEntry(
        shape=tuple(int(d) for d in record["shape"]),
        dtype=str(record["dtype"]),
        pieces=pieces,
        frozen=bool(record.get("frozen", False)),
    )


def _check_file_name(name: str, source: str) -> None:
    """File names in a manifest are plain names inside the checkpoint directory, never paths out of it."""
    if not name or name != os.path.basename(name) or name.startswith(".") or "\\" in name:
        raise CheckpointCorrupt(
            f"{source} lists file {name!r}; only plain file names inside the checkpoint directory are allowed"
        )


def write_manifest(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Atomically write `ckpt_dir/manifest.json`; returns its path."""
    path = Path(ckpt_dir) / MANIFEST_FILE
    write_text_atomic(path, manifest.to_json())
    return path


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    path = Path(ckpt_dir) / MANIFEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} does not exist: {ckpt_dir} is not a Slipstream checkpoint directory. "
            "Pass the tag directory (save_dir/<tag>), or the save_dir together with a tag "
            "or a `latest` file"
        ) from None
    return Manifest.from_json(text, source=str(path))


def check_coverage(manifest: Manifest) -> None:
    """Every tensor's pieces cover [0, numel) exactly once and name listed files; else CheckpointError."""
    problems = []
    for key, entry in manifest.tensors.items():
        numel = entry.numel
        position = 0
        for piece in sorted(entry.pieces, key=lambda p: (p.start, p.end)):
            if piece.file not in manifest.files:
                problems.append(f"{key}: piece {piece.name!r} is in {piece.file!r}, which the manifest does not list")
            if piece.start != position or piece.end < piece.start:
                what = (
                    "ends before it starts"
                    if piece.end < piece.start
                    else "overlaps the previous piece"
                    if piece.start < position
                    else "leaves a gap before it"
                )
                problems.append(
                    f"{key}: piece [{piece.start}, {piece.end}) in {piece.file} {what} (expected start {position})"
                )
            position = max(position, piece.end)
        if position != numel:
            problems.append(f"{key}: pieces end at element {position} but shape {list(entry.shape)} has {numel}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(
            f"the pieces of {len(problems)} tensor slice(s) do not cover their tensors exactly "
            f"once (checkpoint {manifest.tag!r}):\n  {shown}{more}"
        )


def verify_files(
    ckpt_dir: str | os.PathLike[str], manifest: Manifest, *, files: set[str] | None = None, hash_files: bool = True
) -> None:
    """Check the pieces (`check_coverage`), then each listed file's presence, size and sha256.

    All file problems are reported at once in one CheckpointCorrupt. `files` limits the file checks to those
    names (an exporter needs only the files holding model weights); `hash_files=False` checks presence and sizes
    only (the reader's lazy mode hashes each file when it opens it).
    """
    check_coverage(manifest)
    ckpt_dir = Path(ckpt_dir)
    problems = []
    for name, record in manifest.files.items():
        if files is not None and name not in files:
            continue
        path = ckpt_dir / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if size != record.get("bytes"):
            problems.append(f"{name}: size is {size} bytes, the manifest says {record.get('bytes')}")
            continue
        if not hash_files:
            continue
        digest = sha256_file(path)
        if digest != record.get("sha256"):
            problems.append(f"{name}: sha256 is {digest}, the manifest says {record.get('sha256')}")
    if problems:
        raise corrupt_files(ckpt_dir, problems)


def corrupt_files(ckpt_dir: str | os.PathLike[str], problems: list[str]) -> CheckpointCorrupt:
    """The error for files that do not match the manifest, one line per file."""
    return CheckpointCorrupt(
        f"checkpoint {ckpt_dir} is damaged; {len(problems)} file(s) do not match its "
        "manifest:\n  " + "\n  ".join(problems) + "\nRestore these files from a copy, or load an older tag."
    )
