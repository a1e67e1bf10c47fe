"""HashedFileSink: the bytes, size and sha256 of the file it writes, with and without O_DIRECT, and its errors."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

import slipstream.checkpoint.direct_io as direct_io
from slipstream.checkpoint.direct_io import HashedFileSink


def _payload(size: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(size))


@pytest.mark.parametrize("direct", ["1", "0"])
def test_file_bytes_size_and_digest_across_buffer_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """Writes of odd sizes crossing 4 KiB buffers (3 of them, so buffers are reused many times) give the exact
    bytes, unpadded size and sha256, through O_DIRECT or the page cache."""
    monkeypatch.setenv("SLIPSTREAM_AIO_DIRECT", direct)
    monkeypatch.setattr(direct_io, "_CHUNK", 4096)
    pieces = [_payload(n, seed) for seed, n in enumerate([1, 4095, 4097, 8, 30_001, 0, 12_288, 777])]
    path = tmp_path / "out.bin"
    sink = HashedFileSink(path)
    for piece in pieces:
        sink.write(memoryview(piece))
    digest = sink.close()
    expected = b"".join(pieces)
    assert path.read_bytes() == expected
    assert sink.size == len(expected)
    assert digest == hashlib.sha256(expected).hexdigest()
    if direct == "0":
        assert not sink.direct


def test_the_callers_buffer_may_change_after_write(tmp_path: Path) -> None:
    data = bytearray(_payload(10_000))
    original = bytes(data)
    sink = HashedFileSink(tmp_path / "copy.bin", size_hint=len(data))
    sink.write(memoryview(data))
    data[:] = bytes(len(data))  # the caller reuses its memory before the file is closed
    assert sink.close() == hashlib.sha256(original).hexdigest()
    assert (tmp_path / "copy.bin").read_bytes() == original


def test_a_failed_write_is_raised_and_abandon_releases_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error of the writing thread (here a full disk) reaches the caller as that OSError."""
    monkeypatch.setattr(direct_io, "_CHUNK", 4096)

    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(direct_io.os, "pwrite", full)
    sink = HashedFileSink(tmp_path / "full.bin")
    with pytest.raises(OSError) as caught:
        for _ in range(10):
            sink.write(memoryview(_payload(4096)))
        sink.close()
    assert caught.value.errno == errno.ENOSPC
    sink.abandon()
    with pytest.raises(ValueError, match="already closed"):
        sink.write(b"x")


def test_without_pwrite_the_ordered_writes_give_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows has no os.pwrite: one writer thread takes the buffers in order, so plain writes are enough."""
    monkeypatch.setenv("SLIPSTREAM_AIO_DIRECT", "0")
    monkeypatch.setattr(direct_io, "_CHUNK", 4096)
    monkeypatch.delattr(direct_io.os, "pwrite")
    data = _payload(50_000)
    sink = HashedFileSink(tmp_path / "w.bin")
    for start in range(0, len(data), 3000):
        sink.write(memoryview(data)[start : start + 3000])
    assert sink.close() == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "w.bin").read_bytes() == data
