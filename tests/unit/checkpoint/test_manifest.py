"""Manifest JSON, version check, file verification (missing / size / sha256) and piece coverage."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError
from slipstream.checkpoint.manifest import (Manifest, Piece, TensorEntry, check_coverage, dtype_name,
                                            parse_dtype, read_manifest, verify_files)

from .builder import write_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    return {"module/w": torch.randn(4, 5), "module/b": torch.randn(5).bfloat16(), "client/step": torch.tensor(7)}


def test_json_roundtrip(tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path / "c", _tensors(), frozen=("module/b",),
                                scalars={"global_steps": 3, "rng": [1, 2, 3], "config": {"lr": 0.1}})
    again = read_manifest(tmp_path / "c")
    assert again == manifest
    assert again.tensors["module/w"].pieces[1] == Piece(file="rank001.safetensors", name="module/w", start=10, end=20)
    assert again.tensors["module/b"].frozen and not again.tensors["module/w"].frozen
    assert again.tensors["module/b"].torch_dtype == torch.bfloat16
    assert json.loads(again.to_json())["format_version"] == 1


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bf16"
    assert parse_dtype("fp16") is parse_dtype("float16") is parse_dtype("torch.half") is torch.float16
    with pytest.raises(CheckpointError, match="unknown dtype 'fp8'"):
        parse_dtype("fp8")
    with pytest.raises(CheckpointError, match="complex"):
        dtype_name(torch.complex64)


def test_unknown_version_and_malformed(tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path / "c", _tensors())
    document = json.loads(manifest.to_json())
    document["format_version"] = 99
    with pytest.raises(CheckpointError, match="format_version 99; this Slipstream reads format_version 1"):
        Manifest.from_json(json.dumps(document))
    del document["format_version"]
    with pytest.raises(CheckpointError, match="format_version None"):
        Manifest.from_json(json.dumps(document))
    document = json.loads(manifest.to_json())
    del document["world_size"]
    with pytest.raises(CheckpointCorrupt, match="world_size"):
        Manifest.from_json(json.dumps(document))
    document = json.loads(manifest.to_json())
    document["files"]["../escape.safetensors"] = {"sha256": "0", "bytes": 1}
    with pytest.raises(CheckpointCorrupt, match="only plain file names"):
        Manifest.from_json(json.dumps(document))
    with pytest.raises(CheckpointCorrupt, match="not valid JSON"):
        Manifest.from_json("{")
    with pytest.raises(CheckpointError, match="not a Slipstream checkpoint directory"):
        read_manifest(tmp_path)
    bad = dataclasses.replace(manifest, scalars={"obj": object()})
    with pytest.raises(CheckpointError, match="plain JSON"):
        bad.to_json()


def test_flipped_byte_missing_file_and_size_all_reported(tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path / "c", _tensors(), num_files=3)
    verify_files(tmp_path / "c", manifest)
    first = tmp_path / "c" / "rank000.safetensors"
    data = bytearray(first.read_bytes())
    data[-1] ^= 0x01
    first.write_bytes(bytes(data))
    (tmp_path / "c" / "rank001.safetensors").unlink()
    with open(tmp_path / "c" / "rank002.safetensors", "ab") as handle:
        handle.write(b"x")
    with pytest.raises(CheckpointCorrupt) as info:
        verify_files(tmp_path / "c", manifest)
    message = str(info.value)
    assert "rank000.safetensors: sha256 is" in message
    assert "rank001.safetensors: missing" in message
    assert "rank002.safetensors: size is" in message
    verify_files(tmp_path / "c", manifest, files={"nothing-listed"})  # restricted check skips all of them


def _with_pieces(manifest: Manifest, key: str, pieces: list[Piece]) -> Manifest:
    entry = manifest.tensors[key]
    tensors = {**manifest.tensors, key: TensorEntry(shape=entry.shape, dtype=entry.dtype, pieces=pieces)}
    return dataclasses.replace(manifest, tensors=tensors)


def test_pieces_must_cover_exactly_once(tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path / "c", {"module/w": torch.randn(10)})
    check_coverage(manifest)
    file = "rank000.safetensors"
    cases = {
        "leaves a gap": [Piece(file, "w", 0, 4), Piece(file, "w", 5, 10)],
        "overlaps the previous piece": [Piece(file, "w", 0, 6), Piece(file, "w", 5, 10)],
        "pieces end at element 8": [Piece(file, "w", 0, 8)],
        "does not list": [Piece("other.safetensors", "w", 0, 10)],
        "ends before it starts": [Piece(file, "w", 0, 10), Piece(file, "w", 10, 9)],
    }
    for match, pieces in cases.items():
        with pytest.raises(CheckpointError, match=match) as info:
            check_coverage(_with_pieces(manifest, "module/w", pieces))
        assert "module/w" in str(info.value)
    empty = write_checkpoint(tmp_path / "e", {"module/e": torch.empty(0, 3)})
    check_coverage(empty)
