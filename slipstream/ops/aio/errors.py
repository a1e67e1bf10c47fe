"""`AsyncIOError`: a failed async_io request, naming the file, the offset, the size and the OS error.

Raised by both the native op (its C++ failures are translated into this class) and the fallback, at
submission (the file cannot be opened, is too short for the read, or has no room for the write) or at
`wait()` (a transfer failed, the file was truncated or removed while the request was in flight).
"""

from __future__ import annotations

import errno as errno_codes
import os
from typing import Any

# What an errno means for an offload file, in the words a user searches for.
_MEANING = {
    errno_codes.ENOSPC: "disk full",
    errno_codes.EDQUOT: "disk quota exceeded",
    errno_codes.EFBIG: "file size limit exceeded (RLIMIT_FSIZE, `ulimit -f`, or the file system's maximum)",
    errno_codes.ENOENT: "file removed or never written",
    errno_codes.EACCES: "permission denied",
    errno_codes.EROFS: "read-only file system",
}


class AsyncIOError(OSError):
    """An async_io read or write that failed; `errno`, `filename`, `offset`, `size` say which and why.

    `at` is the file offset where the transfer failed, when it is known; `num_failed` counts the failed
    requests of the `wait()` that raised (this error describes the first).
    """

    def __init__(
        self,
        errno: int,
        operation: str,
        filename: str,
        offset: int,
        size: int,
        detail: str = "",
        *,
        at: int | None = None,
        num_failed: int = 1,
    ) -> None:
        super().__init__(errno, os.strerror(errno), filename)
        self.operation = operation
        self.offset = offset
        self.size = size
        self.detail = detail
        self.at = at
        self.num_failed = num_failed

    def __str__(self) -> str:
        text = f"async_io {self.operation} of {self.size} bytes at offset {self.offset} of '{self.filename}' failed"
        if self.at is not None and self.at != self.offset:
            text += f" at file offset {self.at}"
        text += f": [Errno {self.errno}] {self.strerror}"
        meaning = _MEANING.get(self.errno or 0)
        if meaning:
            text += f" ({meaning})"
        if self.detail:
            text += f"; {self.detail}"
        if self.num_failed > 1:
            text += f" ({self.num_failed - 1} more request(s) of the same wait() failed too)"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (self.errno, self.operation, self.filename, self.offset, self.size, self.detail, self.at, self.num_failed),
        )


def _rebuild(
    errno: int, operation: str, filename: str, offset: int, size: int, detail: str, at: int | None, num_failed: int
) -> AsyncIOError:
    return AsyncIOError(errno, operation, filename, offset, size, detail, at=at, num_failed=num_failed)
