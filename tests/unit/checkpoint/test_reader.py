"""CheckpointReader: whole tensors, flat ranges across pieces in two files, verification and tag resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slipstream.checkpoint.atomic import write_latest
from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError
from slipstream.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir

from .builder import write_checkpoint


def test_read_whole_and_flat_ranges(tmp_path: Path) -> None:
    tensors = {"module/w": torch.randn(6, 7), "module/h": torch.randn(9).half(), "module/e": torch.empty(0),
               "optimizer/w/exp_avg": torch.randn(6, 7), "client/mask": torch.rand(5) > 0.5}
    write_checkpoint(tmp_path / "c", tensors, num_files=2, scalars={"global_steps": 4})
    with CheckpointReader(tmp_path / "c") as reader:
        assert reader.keys() == list(tensors)
        assert "module/w" in reader and reader.scalars == {"global_steps": 4}
        for key, expected in tensors.items():
            got = reader.read(key)
            assert got.dtype == expected.dtype and torch.equal(got, expected), key
        flat = tensors["module/w"].reshape(-1)  # pieces [0, 21) in rank000 and [21, 42) in rank001
        for start, end in [(0, 42), (15, 30), (21, 22), (20, 21), (40, 42), (5, 5)]:
            assert torch.equal(reader.read_flat_range("module/w", start, end), flat[start:end]), (start, end)
        with pytest.raises(CheckpointError, match=r"range \[40, 43\) is outside 'module/w'"):
            reader.read_flat_range("module/w", 40, 43)
        with pytest.raises(CheckpointError, match="did you mean"):
            reader.read("module/ww")


def test_reshard_reads_only_own_range(tmp_path: Path) -> None:
    """A 3-rank reader of a 2-file checkpoint gets its padded-free shards and nothing else."""
    weight = torch.arange(100, dtype=torch.float32)
    write_checkpoint(tmp_path / "c", {"module/w": weight}, num_files=2)
    with CheckpointReader(tmp_path / "c") as reader:
        shards = [reader.read_flat_range("module/w", r * 34, min((r + 1) * 34, 100)) for r in range(3)]
    assert torch.equal(torch.cat(shards), weight)


def test_verify_names_corrupt_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "c", {"module/w": torch.randn(50)}, num_files=2)
    path = tmp_path / "c" / "rank001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # inside the last float: the header still parses
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="rank001.safetensors: sha256"):
        CheckpointReader(tmp_path / "c")
    with CheckpointReader(tmp_path / "c", verify=False) as reader:  # opted out: the bytes are read as they are
        assert reader.read("module/w").shape == (50,)


def test_inconsistent_piece_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "c", {"module/w": torch.randn(10)}, num_files=2)
    path = tmp_path / "c" / "manifest.json"
    document = json.loads(path.read_text())
    document["tensors"]["module/w"]["dtype"] = "fp16"
    path.write_text(json.dumps(document))
    with CheckpointReader(tmp_path / "c") as reader, pytest.raises(
            CheckpointError, match="module/w: piece 'module/w' in .*rank000.safetensors is torch.float32"):
        reader.read("module/w")


def test_resolve_checkpoint_dir(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "global_step2", {"module/w": torch.zeros(2)})
    assert resolve_checkpoint_dir(tmp_path / "global_step2") == tmp_path / "global_step2"
    assert resolve_checkpoint_dir(tmp_path, "global_step2") == tmp_path / "global_step2"
    with pytest.raises(CheckpointError, match="neither manifest.json nor a `latest` file"):
        resolve_checkpoint_dir(tmp_path)
    write_latest(tmp_path, "global_step2")
    assert resolve_checkpoint_dir(tmp_path) == tmp_path / "global_step2"
    with pytest.raises(CheckpointError, match=r"tag 'global_step9' not found.*\['global_step2'\]"):
        resolve_checkpoint_dir(tmp_path, "global_step9")
