"""Own safetensors reader/writer: roundtrip every dtype, cross-check with the `safetensors` package, bad headers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.safetensors_io import ST_DTYPES, SafetensorsFile, SafetensorsWriter, save_file, sha256_file


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, dtype=dtype)


def _all_tensors() -> dict[str, torch.Tensor]:
    tensors = {f"t_{name}": _sample(dtype, (3, 5)) for name, dtype in ST_DTYPES.items()}
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.empty(0, 7)
    tensors["odd_bytes"] = _sample(torch.int8, (3,))  # the next tensor starts unaligned
    tensors["strided"] = torch.arange(20.0).reshape(4, 5).t()  # non-contiguous input
    return tensors


def test_roundtrip_every_dtype(tmp_path: Path) -> None:
    tensors = _all_tensors()
    digest = save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "pt"})
    assert digest == sha256_file(tmp_path / "a.safetensors")
    assert digest == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    with SafetensorsFile(tmp_path / "a.safetensors") as handle:
        assert handle.keys() == list(tensors)
        assert handle.metadata == {"format": "pt"}
        for name, expected in tensors.items():
            assert handle.info(name) == (expected.dtype, tuple(expected.shape))
            got = handle.get(name)
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
            flat = expected.reshape(-1)
            if flat.numel() >= 4:
                assert torch.equal(handle.get_flat_range(name, 1, 4), flat[1:4])
            assert handle.get_flat_range(name, 0, 0).numel() == 0
    assert (tmp_path / "a.safetensors").read_bytes()[:8] != b""
    header_len = int.from_bytes((tmp_path / "a.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_result_outlives_the_file(tmp_path: Path) -> None:
    save_file({"x": torch.arange(10.0)}, tmp_path / "x.safetensors")
    with SafetensorsFile(tmp_path / "x.safetensors") as handle:
        got = handle.get("x")
    (tmp_path / "x.safetensors").unlink()
    got += 1  # a fresh, writable tensor that does not depend on the file
    assert torch.equal(got, torch.arange(10.0) + 1)


def test_cross_check_with_safetensors_package(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {k: v.contiguous() for k, v in _all_tensors().items()}
    save_file(tensors, tmp_path / "ours.safetensors", metadata={"k": "v"})
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    assert set(theirs) == set(tensors)
    for name, expected in tensors.items():
        assert theirs[name].dtype == expected.dtype and torch.equal(theirs[name], expected), name
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"k": "v"})
    with SafetensorsFile(tmp_path / "theirs.safetensors") as handle:
        assert handle.metadata == {"k": "v"}
        for name, expected in tensors.items():
            assert torch.equal(handle.get(name), expected), name


def test_writer_checks_order_shape_and_completeness(tmp_path: Path) -> None:
    entries = [("a", torch.float32, (2,)), ("b", torch.int64, (3,))]
    writer = SafetensorsWriter(tmp_path / "w.safetensors", entries)
    with pytest.raises(CheckpointError, match="next entry is 'a'"):
        writer.write("b", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(CheckpointError, match="declared torch.float32"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match=r"entries were written: \['b'\]"):
        writer.close()
    with pytest.raises(CheckpointError, match="twice"):
        SafetensorsWriter(tmp_path / "d.safetensors", [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
    with pytest.raises(CheckpointError, match="str to str"):
        SafetensorsWriter(tmp_path / "m.safetensors", [], metadata={"step": 3})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="complex64"):
        save_file({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "c.safetensors")


def test_context_exits_close_or_abandon(tmp_path: Path) -> None:
    """`with` closes the file on success and abandons it on an error, which then propagates as it was (closing
    would replace it with 'closed before these entries were written')."""
    entries = [("a", torch.float32, (2,)), ("b", torch.int64, (3,))]
    with pytest.raises(RuntimeError, match="interrupted"):
        with SafetensorsWriter(tmp_path / "w.safetensors", entries) as writer:
            writer.write("a", torch.zeros(2))
            raise RuntimeError("interrupted")
    with SafetensorsWriter(tmp_path / "w.safetensors", entries) as writer:
        writer.write("a", torch.ones(2))
        writer.write("b", torch.arange(3))
    with SafetensorsFile(tmp_path / "w.safetensors") as handle:
        assert torch.equal(handle.get("b"), torch.arange(3))


def _write_raw(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes((len(text) if header_len is None else header_len).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize("header, data, match", [
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside the 4 data bytes"),
    ({"x": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "dtype 'Q9'"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "non-negative"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
    ({"x": {"dtype": "F32", "shape": [2]}}, b"", "exactly dtype, shape and data_offsets"),
    ([1, 2], b"", "expected a JSON object"),
])
def test_bad_headers_name_file_and_entry(tmp_path: Path, header: object, data: bytes, match: str) -> None:
    path = _write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=match) as info:
        SafetensorsFile(path)
    assert "bad.safetensors" in str(info.value)


def test_truncated_and_garbage_files(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsFile(short)
    huge = _write_raw(tmp_path / "huge.safetensors", {}, header_len=1 << 40)
    with pytest.raises(CheckpointError, match="does not fit"):
        SafetensorsFile(huge)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes((8).to_bytes(8, "little") + b"{not js}")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(garbage)
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsFile(tmp_path / "nope.safetensors")


def test_flat_range_bounds_and_out(tmp_path: Path) -> None:
    save_file({"x": torch.arange(6, dtype=torch.int32).reshape(2, 3)}, tmp_path / "r.safetensors")
    with SafetensorsFile(tmp_path / "r.safetensors") as handle:
        out = torch.full((3,), -1, dtype=torch.int32)
        assert handle.get_flat_range("x", 2, 5, out=out) is out
        assert out.tolist() == [2, 3, 4]
        with pytest.raises(CheckpointError, match=r"range \[4, 7\) is outside tensor 'x' of 6"):
            handle.get_flat_range("x", 4, 7)
        with pytest.raises(CheckpointError, match="must be a contiguous CPU torch.int32"):
            handle.get_flat_range("x", 0, 2, out=torch.empty(2))
        with pytest.raises(CheckpointError, match="has no tensor 'y'"):
            handle.get("y")


@pytest.mark.parametrize("order", ["none", "in order", "reversed", "overlapping"])
def test_hash_reads_digest_is_the_files_whatever_was_read(tmp_path: Path, order: str) -> None:
    """SafetensorsFile(hash_reads=True) hashes the bytes its reads bring in and reads only the rest: the digest
    equals the file's sha256 for any read pattern, and one changed byte changes it."""
    tensors = {f"t{i}": torch.randn(5000 + 37 * i) for i in range(6)}
    path = tmp_path / "r.safetensors"
    digest = save_file(tensors, path)
    ranges = {
        "none": [],
        "in order": [(name, 0, t.numel()) for name, t in tensors.items()],
        "reversed": [(name, 0, t.numel()) for name, t in reversed(tensors.items())],
        "overlapping": [("t1", 100, 3000), ("t1", 50, 4000), ("t4", 7, 9), ("t0", 0, 10), ("t5", 0, 5185)],
    }[order]
    with SafetensorsFile(path, hash_reads=True) as reader:
        for name, start, end in ranges:
            assert torch.equal(reader.get_flat_range(name, start, end), tensors[name][start:end])
        assert reader.read_digest() == digest
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with SafetensorsFile(path, hash_reads=True) as reader:
        for name, start, end in ranges:
            reader.get_flat_range(name, start, end)
        assert reader.read_digest() != digest
