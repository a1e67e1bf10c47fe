"""Reading and writing the public safetensors format, without the `safetensors` package.

Owns the byte layout: an 8-byte little-endian header length N, N bytes of JSON header
`{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {str: str}}` padded
with spaces to a multiple of 8, then the raw little-endian tensor bytes (offsets count from the end of the
header). Files written here load with `safetensors.torch.load_file` and the other way round.

The writer streams: the header is decided up front from (name, dtype, shape) entries, then each tensor's bytes go
through a `HashedFileSink` (direct_io.py: page-aligned buffers, sha256 and O_DIRECT writes on helper threads), so
a file is hashed without re-reading it and is durable, at the disk's write speed, when `close` returns.
Readers copy only the bytes asked for into fresh torch-owned tensors (no mmap stays open behind a result).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import itertools
import json
import math
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from slipstream.checkpoint.direct_io import HashedFileSink
from slipstream.checkpoint.errors import CheckpointError

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype string -> torch dtype, for every dtype this module reads and writes."""
_ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
_HASH_CHUNK = 8 << 20
_GAP_CHUNK = 1 << 20  # reads of bytes hashed but not asked for (SafetensorsFile(hash_reads=True))
_MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise CheckpointError(
            f"safetensors data is little-endian; this host is {sys.byteorder}-endian, "
            "which Slipstream does not support for checkpoints"
        )


def st_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("F32", "BF16", ...)."""
    if dtype not in _ST_NAMES:
        raise CheckpointError(
            f"dtype {dtype} cannot be stored in safetensors here; supported: "
            f"{sorted(str(d) for d in _ST_NAMES)}. Cast the tensor first."
        )
    return _ST_NAMES[dtype]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor; the caller keeps `tensor` alive while using it."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 hex digest of a file. Two 8 MiB buffers, reused: a helper thread hashes one while this thread reads
    the next into the other (both release the GIL), so the time is the slower of reading and hashing, not both."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        with contextlib.suppress(AttributeError, OSError):  # a hint: larger read-ahead
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        chunk = max(1, min(_HASH_CHUNK, size))
        views = [memoryview(bytearray(chunk)) for _ in range(2)]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-sha256") as pool:
            pending: Future[None] | None = None
            index = 0
            while count := handle.readinto(views[index]):
                if pending is not None:
                    pending.result()  # the other buffer is hashed: the digest stays in file order
                pending = pool.submit(digest.update, views[index][:count])
                index = 1 - index
            if pending is not None:
                pending.result()
    return digest.hexdigest()


_Expected = tuple[str, torch.dtype, tuple[int, ...], int]  # name, dtype, shape, bytes


def _header(
    path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, list[_Expected]]:
    """The padded JSON header for `entries` (data offsets in order) and each entry's expected dtype, shape, size."""
    header: dict[str, object] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise CheckpointError(
                f"safetensors metadata must map str to str; {path} got {bad!r}. "
                "Convert the values with str() or json.dumps() first."
            )
        header["__metadata__"] = dict(metadata)
    expected: list[_Expected] = []
    offset = 0
    for name, dtype, shape in entries:
        if name in header or name == "__metadata__":
            raise CheckpointError(f"tensor name {name!r} appears twice (or is reserved) in {path}")
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": st_dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        expected.append((name, dtype, shape, nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return text + b" " * (-len(text) % 8), expected


def file_bytes(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> int:
    """The size of the safetensors file that `SafetensorsWriter(path, entries, metadata)` writes."""
    text, expected = _header(Path("<planned>"), entries, metadata)
    return 8 + len(text) + sum(entry[3] for entry in expected)


_Closing = TypeVar("_Closing", bound="ClosesOnExit")


class ClosesOnExit:
    """A context manager whose exit is `close()`, or `_abandon()` when an exception is on its way out."""

    def close(self) -> object:
        raise NotImplementedError

    def _abandon(self) -> None:
        """Release what is held after an error; closing, unless a subclass knows better."""
        self.close()

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abandon()


class SafetensorsWriter(ClosesOnExit):
    """Streams tensors into one safetensors file whose header is fixed by `entries` at construction.

    Call `write(name, tensor)` once per entry, in `entries` order, then `close()`, which checks that every
    entry was written, fsyncs and returns the sha256 of the whole file. `bytes_written` is the file size.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        _require_little_endian()
        self.path = Path(path)
        text, self._expected = _header(self.path, entries, metadata)
        self.planned_bytes = 8 + len(text) + sum(entry[3] for entry in self._expected)
        """The size the file will have once every entry is written."""
        self._sink: HashedFileSink | None = HashedFileSink(self.path, size_hint=self.planned_bytes)
        self._digest = ""
        self._next = 0
        self.bytes_written = 0
        try:
            self._emit(memoryview(len(text).to_bytes(8, "little")))
            self._emit(memoryview(text))
        except BaseException:  # e.g. a full disk: no `with` block will close the handle for us
            self._abandon()
            raise

    def _emit(self, data: memoryview) -> None:
        if self._sink is None:
            raise CheckpointError(f"{self.path} is already closed; create a new SafetensorsWriter")
        self._sink.write(data)  # copied into the sink's buffers: `data` may be freed after this returns
        self.bytes_written += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor` as entry `name`; it must be the next entry, with the declared dtype and shape."""
        if self._next >= len(self._expected):
            raise CheckpointError(
                f"{self.path}: write({name!r}) after all {len(self._expected)} entries were "
                "written; declare every tensor in `entries`"
            )
        expected_name, dtype, shape, _ = self._expected[self._next]
        if name != expected_name:
            raise CheckpointError(
                f"{self.path}: got tensor {name!r} but the next entry is {expected_name!r}; "
                "write tensors in the order given to SafetensorsWriter(entries=...)"
            )
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)} but was "
                f"declared {dtype} {shape}; cast or reshape it, or fix the entries"
            )
        data = tensor.detach().to("cpu").contiguous()
        self._emit(_byte_view(data))
        self._next += 1
        del data

    def close(self) -> str:
        """Check that every entry was written, make the file durable; returns the file's sha256 hex digest."""
        if self._sink is None:
            return self._digest
        if self._next != len(self._expected):
            missing = [entry[0] for entry in self._expected[self._next :]]
            self._abandon()
            raise CheckpointError(
                f"{self.path} closed before these entries were written: {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}; call write() for each of them"
            )
        sink, self._sink = self._sink, None
        try:
            self._digest = sink.close()
        except BaseException:
            sink.abandon()
            raise
        return self._digest

    def _abandon(self) -> None:
        """Release the file after an error; the error on its way is the one to report, not a failed write of the
        bytes still buffered (a full disk fails those as well)."""
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.abandon()


def save_file(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> str:
    """Write `tensors` to one safetensors file; returns its sha256 hex digest."""
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with SafetensorsWriter(path, entries, metadata) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    return writer.close()


def _parse_header(
    path: Path, raw: bytes, data_len: int
) -> tuple[dict[str, str], dict[str, tuple[str, list[int], int, int]]]:
    """Validate a header; returns (metadata, {name: (st dtype, shape, begin, end)})."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: the safetensors header is not valid JSON ({exc}); the file is corrupt or not a safetensors file"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is {type(header).__name__}, expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map str to str, got {metadata!r}")
    entries: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        where = f"{path}: entry {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where} must have exactly dtype, shape and data_offsets, got {info!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in ST_DTYPES:
            raise CheckpointError(f"{where} has dtype {dtype!r}; this reader knows {sorted(ST_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{where} has shape {shape!r}; expected a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CheckpointError(
                f"{where} has data_offsets {offsets!r} outside the {data_len} data bytes; "
                "the file is truncated or corrupt"
            )
        nbytes = math.prod(shape) * ST_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(
                f"{where} spans {offsets[1] - offsets[0]} bytes but {dtype} {shape} needs {nbytes}; the file is corrupt"
            )
        entries[name] = (dtype, shape, offsets[0], offsets[1])
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items() if end > begin)
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CheckpointError(f"{path}: entries {name_a!r} and {name_b!r} overlap; the file is corrupt")
    return metadata, entries


class SafetensorsFile(ClosesOnExit):
    """Random access to one safetensors file: parse the header once, read any tensor or flat range of it."""

    def __init__(self, path: str | os.PathLike[str], *, hash_reads: bool = False) -> None:
        _require_little_endian()
        self.path = Path(path)
        self._digest = hashlib.sha256() if hash_reads else None
        self._hashed = 0  # with hash_reads: the file's bytes [0, _hashed) are in the digest
        try:
            self._file: io.FileIO | None = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointError(f"safetensors file {self.path} does not exist") from None
        try:
            size = os.fstat(self._file.fileno()).st_size
            prefix = self._file.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{self.path} is {size} bytes, too short for a safetensors header")
            header_len = int.from_bytes(prefix, "little")
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{self.path}: header length {header_len} does not fit the {size}-byte file; "
                    "the file is truncated or not a safetensors file"
                )
            raw = self._file.read(header_len)
            self._data_start = 8 + header_len
            self.metadata, self._entries = _parse_header(self.path, raw, size - self._data_start)
            self._account(0, memoryview(prefix + raw))
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> tuple[str, list[int], int, int]:
        if name not in self._entries:
            raise CheckpointError(
                f"{self.path} has no tensor {name!r}; it holds {len(self._entries)} tensors, "
                f"e.g. {list(self._entries)[:5]}"
            )
        return self._entries[name]

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(torch dtype, shape) of tensor `name`, from the header alone."""
        dtype, shape, _, _ = self._entry(name)
        return ST_DTYPES[dtype], tuple(shape)

    def _read_into(self, offset: int, out: torch.Tensor) -> None:
        if self._file is None:
            raise CheckpointError(f"{self.path} is closed; open a new SafetensorsFile")
        view = _byte_view(out)
        self._file.seek(self._data_start + offset)
        filled = 0
        while filled < len(view):
            count = self._file.readinto(view[filled:])
            if not count:
                position = self._data_start + offset + filled
                raise CheckpointError(f"{self.path}: unexpected end of file at byte {position}; the file is truncated")
            filled += count
        self._account(self._data_start + offset, view)

    def _account(self, position: int, data: memoryview) -> None:
        """With hash_reads, add the file's bytes [position, position + len(data)), just read into `data`, to the
        digest: bytes skipped since the last read are read and hashed first, bytes read twice are hashed once.
        Reads in file order (the common case: pieces are written and read in the same order) read every byte
        once."""
        if self._digest is None:
            return
        if position > self._hashed:
            self._hash_through(position)
        end = position + len(data)
        if end > self._hashed:
            self._digest.update(data[self._hashed - position :])
            self._hashed = end

    def _hash_through(self, end: int) -> None:
        """Read and hash the file's bytes [_hashed, end)."""
        if self._file is None or self._digest is None:
            raise CheckpointError(f"{self.path} is closed; open a new SafetensorsFile")
        scratch = memoryview(bytearray(min(_GAP_CHUNK, max(1, end - self._hashed))))
        self._file.seek(self._hashed)
        while self._hashed < end:
            count = self._file.readinto(scratch[: min(len(scratch), end - self._hashed)])
            if not count:
                raise CheckpointError(f"{self.path}: unexpected end of file at byte {self._hashed}; it is truncated")
            self._digest.update(scratch[:count])
            self._hashed += count

    def read_digest(self) -> str:
        """With hash_reads: the sha256 of the whole file, hashing (reading) only the bytes no read has covered."""
        if self._digest is None:
            raise CheckpointError(f"{self.path} was opened without hash_reads=True; use sha256_file")
        if self._file is None:
            raise CheckpointError(f"{self.path} is closed; open a new SafetensorsFile")
        self._hash_through(os.fstat(self._file.fileno()).st_size)
        return self._digest.hexdigest()

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` as a fresh CPU tensor (reads only its bytes)."""
        _, shape = self.info(name)
        flat = self.get_flat_range(name, 0, math.prod(shape))
        return flat.reshape(shape)

    def get_flat_range(self, name: str, start: int, end: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `name`, reading only those bytes.

        With `out` (a contiguous 1-D CPU tensor of the stored dtype and `end - start` elements) the bytes land
        there directly and `out` is returned.
        """
        st_dtype, shape, begin, _ = self._entry(name)
        dtype, numel = ST_DTYPES[st_dtype], math.prod(shape)
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{self.path}: range [{start}, {end}) is outside tensor {name!r} of {numel} elements")
        if out is None:
            out = torch.empty(end - start, dtype=dtype)
        elif out.dtype != dtype or out.numel() != end - start or out.device.type != "cpu" or not out.is_contiguous():
            raise CheckpointError(
                f"{self.path}: `out` for {name!r} must be a contiguous CPU {dtype} tensor of "
                f"{end - start} elements, got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        self._read_into(begin + start * out.element_size(), out)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
