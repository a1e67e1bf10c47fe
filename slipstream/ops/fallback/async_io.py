"""Pure-Python `async_io`: the native module's `aio_handle`, on a thread pool of os.preadv / os.pwritev.

Same interface as slipstream/ops/csrc/aio/aio_py.cpp. Used where the native op cannot be built (no liburing
or libaio development files, no compiler) or with SLIPSTREAM_OPS=fallback. The plan of a request follows
[Note: aio request plan] in slipstream/ops/csrc/aio/aio_engine.h, except that a buffer not aligned like its
file offset uses plain I/O for the whole request (no bounce buffers). The syscalls release the GIL, so
`min(intra_op_parallelism * queue_depth, 8)` threads keep that many transfers in flight.
single_submit and overlap_events are accepted and reported, and change nothing here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno as errno_codes
import functools
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from slipstream.ops.aio.errors import AsyncIOError

ALIGNMENT = 4096
_MAX_THREADS = 8


def engines() -> list[str]:
    """Always ['python'] (the native module lists the engines compiled into it)."""
    return ["python"]


@dataclasses.dataclass(eq=False)
class _Request:
    is_read: bool
    filename: str
    offset: int
    nbytes: int
    tensor: torch.Tensor  # owns `view` until wait()
    view: memoryview
    fd_plain: int
    fd_direct: int = -1
    futures: list[Future[None]] = dataclasses.field(default_factory=list)
    err: int = 0
    err_at: int | None = None
    detail: str = ""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def fail(self, err: int, at: int | None, detail: str = "") -> None:
        with self.lock:
            if not self.err:
                self.err, self.err_at, self.detail = err, at, detail

    def error(self, err: int, detail: str, *, at: int | None = None, num_failed: int = 1) -> AsyncIOError:
        return AsyncIOError(
            err,
            "read" if self.is_read else "write",
            self.filename,
            self.offset,
            self.nbytes,
            detail,
            at=at,
            num_failed=num_failed,
        )

    def close(self) -> None:
        for fd in (self.fd_direct, self.fd_plain):
            if fd >= 0:
                os.close(fd)
        self.fd_direct = self.fd_plain = -1

    def __del__(self) -> None:
        # a request abandoned by a handle that died before waiting: its files close when its last job is done
        with contextlib.suppress(Exception):
            self.close()


def _byte_view(tensor: torch.Tensor, method: str) -> memoryview:
    if tensor.device.type != "cpu":
        raise ValueError(
            f"aio_handle.{method}: the tensor is on {tensor.device}; async_io moves CPU tensors "
            "(copy to a pinned host buffer first)"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"aio_handle.{method}: the tensor (shape {list(tensor.shape)}) is not contiguous; pass tensor.contiguous()"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _open_error_detail(err: int, is_read: bool) -> str:
    if err == errno_codes.ENOENT and not is_read:
        return "open for write: its directory does not exist"
    return "open for read" if is_read else "open for write"


class aio_handle:  # DeepSpeed's name, so both modules have the same face
    """Asynchronous tensor reads and writes to files; see the module docstring."""

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = True,
        intra_op_parallelism: int = 1,
    ) -> None:
        if not (0 < block_size <= 1 << 30 and 0 < queue_depth <= 4096 and 0 < intra_op_parallelism <= 256):
            raise ValueError(
                "aio_handle: block_size must be in [1, 2**30], queue_depth in [1, 4096] and "
                f"intra_op_parallelism in [1, 256] (got {block_size}, {queue_depth}, "
                f"{intra_op_parallelism})"
            )
        self._block_size = block_size
        self._queue_depth = queue_depth
        self._single_submit = single_submit
        self._overlap_events = overlap_events
        self._intra_op_parallelism = intra_op_parallelism
        self._use_direct = os.environ.get("SLIPSTREAM_AIO_DIRECT", "1") != "0" and hasattr(os, "O_DIRECT")
        self._pool = ThreadPoolExecutor(
            max_workers=min(intra_op_parallelism * queue_depth, _MAX_THREADS), thread_name_prefix="slipstream-aio"
        )
        self._pending: list[_Request] = []
        self._locked: set[int] = set()

    # ---- DeepSpeed's methods ----
    def async_pread(self, buffer: torch.Tensor, filename: str | os.PathLike[str], file_offset: int = 0) -> int:
        self._submit(True, buffer, filename, file_offset, "async_pread")
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike[str], file_offset: int = 0) -> int:
        self._submit(False, buffer, filename, file_offset, "async_pwrite")
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename: str | os.PathLike[str], file_offset: int = 0) -> int:
        self._submit(True, buffer, filename, file_offset, "sync_pread")
        return self.wait()

    def sync_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike[str], file_offset: int = 0) -> int:
        self._submit(False, buffer, filename, file_offset, "sync_pwrite")
        return self.wait()

    def wait(self) -> int:
        """Block until every submitted request finished; returns how many, raises the first failure."""
        done, self._pending = self._pending, []
        for req in done:
            for future in req.futures:
                future.result()  # jobs record their errors in the request; this only waits
            req.close()
            if not req.is_read and not req.err and not os.path.exists(req.filename):
                req.fail(errno_codes.ENOENT, req.offset, "the file was removed before wait(); what was written is lost")
        failed = [req for req in done if req.err]
        if failed:
            first = failed[0]
            raise first.error(first.err, first.detail, at=first.err_at, num_failed=len(failed))
        return len(done)

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned CPU tensor of `num_elem` elements of `example_tensor`'s dtype (anonymous mmap)."""
        if num_elem < 0:
            raise ValueError("new_cpu_locked_tensor: num_elem must be >= 0")
        nbytes = num_elem * example_tensor.element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=example_tensor.dtype)
        buffer = mmap.mmap(-1, (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
        tensor = torch.frombuffer(buffer, dtype=example_tensor.dtype, count=num_elem)
        self._locked.add(tensor.data_ptr())
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        if tensor.data_ptr() not in self._locked:
            return False
        self._locked.discard(tensor.data_ptr())
        tensor.set_()  # type: ignore[call-overload]  # empty now; the memory goes with its last view
        return True

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        return ALIGNMENT

    def engine(self) -> str:
        return "python"

    # ---- requests ----
    def _submit(
        self, is_read: bool, tensor: torch.Tensor, filename: str | os.PathLike[str], offset: int, method: str
    ) -> None:
        view = _byte_view(tensor, method)
        if offset < 0:
            raise ValueError(f"async_io: file_offset must be >= 0, got {offset}")
        path = os.fspath(filename)
        flags = (os.O_RDONLY if is_read else os.O_WRONLY | os.O_CREAT) | os.O_CLOEXEC
        req = _Request(is_read, path, offset, len(view), tensor, view, fd_plain=-1)
        try:
            req.fd_plain = os.open(path, flags, 0o600)
        except OSError as exc:
            raise req.error(exc.errno or errno_codes.EIO, _open_error_detail(exc.errno or 0, is_read)) from None
        try:
            self._prepare(req)
        except BaseException:
            req.close()
            raise
        jobs = self._plan(req)
        if not jobs:
            req.close()
        req.futures = [self._pool.submit(self._transfer, req, pos, length, direct) for pos, length, direct in jobs]
        self._pending.append(req)

    def _prepare(self, req: _Request) -> None:
        """Size checks, the O_DIRECT descriptor, and block reservation for writes."""
        end = req.offset + req.nbytes
        size = os.fstat(req.fd_plain).st_size
        if req.is_read and req.nbytes > 0 and size < end:
            raise req.error(
                errno_codes.EIO,
                f"short read: the file is {size} bytes long, the read needs bytes [{req.offset}, {end})",
            )
        body_begin, body_end = _body(req.offset, end)
        aligned = (req.tensor.data_ptr() + body_begin - req.offset) % ALIGNMENT == 0
        if self._use_direct and body_end > body_begin and aligned:
            try:
                req.fd_direct = os.open(
                    req.filename, (os.O_RDONLY if req.is_read else os.O_WRONLY) | os.O_DIRECT | os.O_CLOEXEC
                )
            except OSError:
                req.fd_direct = -1  # this file system has no O_DIRECT: plain I/O
        if not req.is_read and size < end:
            err = _fallocate(req.fd_plain, req.offset, req.nbytes)
            if err in (errno_codes.ENOSPC, errno_codes.EDQUOT, errno_codes.EFBIG):
                raise req.error(err, "reserving the file's blocks")

    def _plan(self, req: _Request) -> list[tuple[int, int, bool]]:
        """(position in the request, length, direct) of each transfer."""
        end = req.offset + req.nbytes
        if req.fd_direct < 0:
            return [
                (p - req.offset, min(self._block_size, end - p), False)
                for p in range(req.offset, end, self._block_size)
            ]
        body_begin, body_end = _body(req.offset, end)
        step = (self._block_size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        jobs = [(0, body_begin - req.offset, False)] if body_begin > req.offset else []
        jobs += [(p - req.offset, min(step, body_end - p), True) for p in range(body_begin, body_end, step)]
        if end > body_end:
            jobs.append((body_end - req.offset, end - body_end, False))
        return jobs

    def _transfer(self, req: _Request, pos: int, length: int, direct: bool) -> None:
        done = 0
        while done < length:
            if req.err:
                return  # the request already failed; do not spend the disk on the rest
            at = req.offset + pos + done
            fd = req.fd_direct if direct else req.fd_plain
            part = req.view[pos + done : pos + length]
            try:
                n = os.preadv(fd, [part], at) if req.is_read else os.pwritev(fd, [part], at)
            except InterruptedError:
                continue
            except OSError as exc:
                req.fail(exc.errno or errno_codes.EIO, at)
                return
            if n == 0:
                req.fail(
                    errno_codes.EIO,
                    at,
                    f"short read: the file ends at byte {at} (truncated while the read was in flight?)"
                    if req.is_read
                    else "the write made no progress",
                )
                return
            done += n
            direct = False  # a partial direct transfer finishes with plain I/O (the rest may be unaligned)

    def __del__(self) -> None:
        # Garbage collection can run this in any thread, even in a thread the pool's workers or a caller are
        # waiting on; joining the workers here deadlocked (seen once in the NVMe tests). So never block: the
        # workers finish what is queued and exit; a request's files are closed here only once it is done, and
        # otherwise when the request object dies with its last future.
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        for req in getattr(self, "_pending", []):
            if all(future.done() for future in req.futures):
                req.close()


@functools.cache
def _libc_fallocate() -> Any:
    """libc's fallocate(2), or None where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return function


def _fallocate(fd: int, offset: int, length: int) -> int:
    """Linux fallocate(2): 0 or the errno. Unlike os.posix_fallocate it never falls back to writing zeros."""
    function = _libc_fallocate()
    if function is None:
        return errno_codes.EOPNOTSUPP
    return 0 if function(fd, 0, offset, length) == 0 else ctypes.get_errno()


def _body(begin: int, end: int) -> tuple[int, int]:
    """The aligned middle [body_begin, body_end) of the file range [begin, end) (may be empty)."""
    return (begin + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT, end // ALIGNMENT * ALIGNMENT
