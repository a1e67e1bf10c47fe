"""DeepSpeed's (Megatron's) memory-mapped indexed dataset: the on-disk format of the data analyzer's metric
indexes and of what the curriculum sampler reads.

A dataset `<prefix>` is two files. `<prefix>.bin` holds every row's elements back to back, in one integer
dtype. `<prefix>.idx` is, little-endian:
- the 9 magic bytes `MMIDIDX\\0\\0`, a u64 version (1), a u8 dtype code (`DTYPE_CODES`);
- u64 number of rows n, u64 number of document boundaries d;
- n int32 row lengths, n int64 byte offsets of the rows in `.bin`, d int64 document boundaries (row numbers,
  starting with 0; the analyzer ends one document after all rows).
Files written here load in DeepSpeed's `MMapIndexedDataset` and DeepSpeed's load here.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["DTYPE_CODES", "IndexedDatasetWriter", "IndexedDataset", "smallest_int_dtype", "write_rows"]

_MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES: dict[int, type[np.integer]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.uint16,
    7: np.uint32,
    8: np.uint64,
}
_CODE_OF = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def smallest_int_dtype(low: int, high: int) -> type[np.integer]:
    """The narrowest integer dtype holding [low, high] (unsigned when low >= 0), as DeepSpeed picks them."""
    unsigned = (np.uint8, np.uint16, np.uint32, np.uint64)
    signed = (np.int8, np.int16, np.int32, np.int64)
    for dtype in unsigned if low >= 0 else signed:
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return np.uint64 if low >= 0 else np.int64


def _code(dtype: npt.DTypeLike) -> int:
    code = _CODE_OF.get(np.dtype(dtype))
    if code is None:
        names = sorted(np.dtype(d).name for d in DTYPE_CODES.values())
        raise ValueError(f"indexed dataset dtype {np.dtype(dtype).name} is not one DeepSpeed's format has; use {names}")
    return code


class IndexedDatasetWriter:
    """Write rows to `<prefix>.bin`; `finish()` writes `<prefix>.idx` (one document over all rows)."""

    def __init__(self, prefix: str, dtype: npt.DTypeLike) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        _code(self.dtype)
        self._data = open(f"{prefix}.bin", "wb")
        self._sizes: list[int] = []

    def add(self, row: npt.ArrayLike) -> None:
        array = np.ascontiguousarray(np.asarray(row).reshape(-1).astype(self.dtype, copy=False))
        self._data.write(array.tobytes(order="C"))
        self._sizes.append(int(array.size))

    def finish(self) -> None:
        self._data.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        offsets = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            offsets[1:] = np.cumsum(sizes[:-1] * self.dtype.itemsize)
        documents = np.asarray([0, len(sizes)], dtype=np.int64)
        with open(f"{self.prefix}.idx", "wb") as index:
            index.write(_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _code(self.dtype)))
            index.write(struct.pack("<QQ", len(sizes), len(documents)))
            index.write(sizes.astype(np.int32).tobytes(order="C"))
            index.write(offsets.tobytes(order="C"))
            index.write(documents.tobytes(order="C"))


def write_rows(prefix: str, rows: Sequence[npt.ArrayLike], dtype: npt.DTypeLike) -> None:
    """`<prefix>.bin/.idx` holding `rows`."""
    writer = IndexedDatasetWriter(prefix, dtype)
    for row in rows:
        writer.add(row)
    writer.finish()


class IndexedDataset:
    """Read `<prefix>.bin/.idx`: `dataset[i]` is row i (a read-only numpy view into the memory map)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        for suffix in (".idx", ".bin"):
            if not os.path.isfile(prefix + suffix):
                raise FileNotFoundError(
                    f"indexed dataset {prefix!r}: {prefix + suffix} does not exist; give the path prefix without "
                    "the .bin/.idx suffix (the data analyzer writes <save_path>/<metric>/<metric>_index_to_sample)"
                )
        with open(f"{prefix}.idx", "rb") as stream:
            header = stream.read(9 + 8 + 1 + 16)
        if header[:9] != _MAGIC or struct.unpack("<Q", header[9:17]) != (1,):
            raise ValueError(f"{prefix}.idx is not a version-1 memory-mapped indexed dataset index (bad header)")
        self.dtype = np.dtype(DTYPE_CODES[header[17]])
        num_rows, num_documents = struct.unpack("<QQ", header[18:34])
        index = np.memmap(f"{prefix}.idx", mode="r", order="C")
        start = 34
        self.sizes = np.frombuffer(index, dtype=np.int32, count=num_rows, offset=start)
        self.pointers = np.frombuffer(index, dtype=np.int64, count=num_rows, offset=start + 4 * num_rows)
        self.document_index = np.frombuffer(index, dtype=np.int64, count=num_documents, offset=start + 12 * num_rows)
        size = os.path.getsize(f"{prefix}.bin")
        self._data = np.memmap(f"{prefix}.bin", mode="r", order="C") if size else np.zeros(0, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, row: int) -> npt.NDArray[np.integer]:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} of indexed dataset {self.prefix!r}, which has {len(self)} rows")
        row %= len(self)
        return np.frombuffer(self._data, dtype=self.dtype, count=int(self.sizes[row]), offset=int(self.pointers[row]))

    def __iter__(self) -> Iterator[npt.NDArray[np.integer]]:
        return (self[row] for row in range(len(self)))
