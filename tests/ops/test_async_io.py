"""async_io op (native on each engine, and the fallback): round trips, concurrency, errors, the builder."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import pickle
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

import slipstream.ops.fallback.async_io as fallback_op
from slipstream.config import AioPlan
from slipstream.config.zero_plans import default_aio_plan
from slipstream.ops.aio import AsyncIOError, AsyncIOHandle
from slipstream.ops.op_builder import AsyncIOBuilder, OpBuildError, OpIncompatibleError
from slipstream.ops.op_builder import async_io as builder_mod
from slipstream.ops.op_builder import builder as op_builder_mod

REPO = Path(__file__).resolve().parents[2]
SIZES = (0, 1, 7, 4095, 4096, 4097, 100_003, (1 << 18) + 5)  # bytes; the last spans several 64 KiB chunks
OFFSETS = (0, 4096, 5003)  # aligned, aligned past the start, unaligned (head + body + tail)
BLOCK = 1 << 16


@pytest.fixture(scope="module")
def native_op() -> ModuleType:
    try:
        return AsyncIOBuilder().jit_load()
    except (OpIncompatibleError, OpBuildError) as exc:
        pytest.skip(f"native async_io cannot be built here: {exc}")


@pytest.fixture(params=["native-libaio", "native-io_uring", "native-sync", "fallback"])
def op(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The module under test; for native, SLIPSTREAM_AIO_ENGINE pins the engine of the handles it makes."""
    if request.param == "fallback":
        return fallback_op
    request.applymarker(pytest.mark.needs_compiler)
    module: ModuleType = request.getfixturevalue("native_op")
    engine = request.param.removeprefix("native-")
    if engine not in module.engines():
        pytest.skip(f"engine {engine} is not compiled in (compiled: {module.engines()})")
    monkeypatch.setenv("SLIPSTREAM_AIO_ENGINE", engine)
    handle = module.aio_handle(BLOCK, 4, False, True, 1)
    assert handle.engine() == engine
    return module


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_round_trip_odd_sizes_unaligned_tails_and_offsets(op: ModuleType, tmp_path: Path) -> None:
    handle = op.aio_handle(BLOCK, 4, False, True, 1)
    example = torch.empty(0, dtype=torch.uint8)
    for i, n in enumerate(SIZES):
        for offset in OFFSETS:
            path = tmp_path / f"f{n}_{offset}.bin"
            for aligned in (False, True):  # torch.empty (64 bytes into a page) and a page-aligned buffer
                src = handle.new_cpu_locked_tensor(n, example) if aligned else torch.empty(n, dtype=torch.uint8)
                src.copy_(_bytes(n, i))
                assert handle.async_pwrite(src, str(path), offset) == 0
                assert handle.wait() == 1
                dst = handle.new_cpu_locked_tensor(n, example) if aligned else torch.empty(n, dtype=torch.uint8)
                dst.fill_(0)
                assert handle.sync_pread(dst, path, offset) == 1
                assert torch.equal(src, dst), (n, offset, aligned)
            if n:
                assert path.stat().st_size == offset + n
    assert handle.wait() == 0


def test_many_concurrent_requests_then_one_wait(op: ModuleType, tmp_path: Path) -> None:
    handle = op.aio_handle(BLOCK, 8, False, True, 2)
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.float16)
    srcs = [torch.randn(997 + 131 * i).to(dtypes[i % 4]) for i in range(120)]
    places = [(str(tmp_path / f"shared{i % 3}.swp"), (i // 3) * (1 << 17) + (i % 5)) for i in range(len(srcs))]
    for src, (path, offset) in zip(srcs, places):
        handle.async_pwrite(src, path, offset)
    assert handle.wait() == len(srcs)
    dsts = [torch.empty_like(s) for s in srcs]
    for dst, (path, offset) in zip(dsts, places):
        handle.async_pread(dst, path, offset)
    assert handle.wait() == len(dsts)
    for src, dst in zip(srcs, dsts):
        assert torch.equal(src, dst)


def test_sync_calls_also_wait_for_pending_requests(op: ModuleType, tmp_path: Path) -> None:
    handle = op.aio_handle(BLOCK, 4, False, True, 1)
    t = torch.arange(5000, dtype=torch.float32)
    for k in range(3):
        handle.async_pwrite(t, tmp_path / f"a{k}", 0)
    assert handle.sync_pwrite(t, tmp_path / "b", 0) == 4  # DeepSpeed: the count of every completed request


def test_write_creates_private_file_and_keeps_other_bytes(op: ModuleType, tmp_path: Path) -> None:
    handle = op.aio_handle(BLOCK, 4, False, True, 1)
    path = tmp_path / "keep.bin"
    base = _bytes(3 * 4096 + 11, 1)
    handle.sync_pwrite(base, path, 0)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    patch = _bytes(4096 + 100, 2)
    handle.sync_pwrite(patch, path, 2000)
    expected = base.clone()
    expected[2000:2000 + patch.numel()] = patch
    assert path.read_bytes() == expected.numpy().tobytes()


def test_submit_and_wait_variants_and_getters(op: ModuleType, tmp_path: Path) -> None:
    for single_submit, overlap_events in ((True, False), (False, False), (True, True)):
        handle = op.aio_handle(8192, 3, single_submit, overlap_events, 2)
        assert (handle.get_block_size(), handle.get_queue_depth(), handle.get_single_submit(),
                handle.get_overlap_events(), handle.get_intra_op_parallelism()) == (8192, 3, single_submit,
                                                                                    overlap_events, 2)
        src = torch.randn(100_000)
        handle.sync_pwrite(src, tmp_path / "v.bin", 4096)
        dst = torch.empty_like(src)
        handle.sync_pread(dst, tmp_path / "v.bin", 4096)
        assert torch.equal(src, dst)
    assert handle.get_alignment() == 4096


def test_argument_errors(op: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="queue_depth"):
        op.aio_handle(BLOCK, 0, False, True, 1)
    handle = op.aio_handle(BLOCK, 4, False, True, 1)
    with pytest.raises(ValueError, match="not contiguous"):
        handle.async_pwrite(torch.randn(8, 8).t(), tmp_path / "x", 0)
    with pytest.raises(ValueError, match="file_offset must be >= 0"):
        handle.async_pwrite(torch.randn(8), tmp_path / "x", -1)


def test_short_read_and_missing_file_are_named_errors(op: ModuleType, tmp_path: Path) -> None:
    handle = op.aio_handle(BLOCK, 4, False, True, 1)
    path = tmp_path / "short.bin"
    handle.sync_pwrite(torch.zeros(1000, dtype=torch.uint8), path, 0)
    with pytest.raises(AsyncIOError) as info:
        handle.async_pread(torch.empty(8192, dtype=torch.uint8), path, 100)
    err = info.value
    assert (err.errno, err.filename, err.offset, err.size, err.operation) == (errno.EIO, str(path), 100, 8192, "read")
    assert "short read" in str(err) and "1000 bytes long" in str(err) and str(path) in str(err)
    with pytest.raises(AsyncIOError) as info:
        handle.async_pread(torch.empty(4), tmp_path / "never-written.bin", 0)
    assert info.value.errno == errno.ENOENT and "never-written.bin" in str(info.value)
    with pytest.raises(AsyncIOError, match="its directory does not exist"):
        handle.async_pwrite(torch.empty(4), tmp_path / "no-dir" / "x.bin", 0)
    assert handle.wait() == 0  # failed submissions are never queued


def test_file_removed_before_wait_fails_the_write(op: ModuleType, tmp_path: Path) -> None:
    handle = op.aio_handle(BLOCK, 4, False, True, 1)
    path = tmp_path / "gone.bin"
    handle.async_pwrite(torch.randn(50_000), path, 0)
    handle.async_pwrite(torch.randn(10), tmp_path / "stays.bin", 0)
    path.unlink()
    with pytest.raises(AsyncIOError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOENT and "removed" in str(info.value) and str(path) in str(info.value)
    assert handle.wait() == 0  # the failure was reported once; nothing is left pending


def test_locked_tensors_are_page_aligned_and_freed(op: ModuleType) -> None:
    handle = op.aio_handle(BLOCK, 4, False, True, 1)
    t = handle.new_cpu_locked_tensor(12_345, torch.empty(0, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.numel() == 12_345 and t.data_ptr() % 4096 == 0
    t.fill_(1.5)
    assert not handle.free_cpu_locked_tensor(torch.empty(3))
    assert handle.free_cpu_locked_tensor(t) and t.numel() == 0
    assert handle.new_cpu_locked_tensor(0, torch.empty(0)).numel() == 0


_FULL_DISK_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    import torch
    from slipstream.ops.aio import AsyncIOError
    from slipstream.ops.op_builder import AsyncIOBuilder
    import slipstream.ops.fallback.async_io as fallback_op

    rlimit_dir, tmpfs_dir, use_native = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over RLIMIT_FSIZE, write() then fails with EFBIG
    modules = {"fallback": fallback_op}
    if use_native:
        modules["native"] = AsyncIOBuilder().jit_load()

    def write_all(directory, cases):
        for name, module in modules.items():
            handle = module.aio_handle(1 << 16, 4, False, True, 1)
            for case in cases:
                path = os.path.join(directory, f"{name}-{case}.bin")
                try:
                    handle.async_pwrite(torch.ones(1 << 20, dtype=torch.uint8), path, 0)
                    handle.wait()
                    report[path] = None
                except AsyncIOError as exc:
                    report[path] = [exc.errno, exc.filename, exc.offset, exc.size, str(exc)]

    report = {}
    if tmpfs_dir != "-":
        write_all(tmpfs_dir, ["new"])  # 1 MiB into a 512 KiB tmpfs: ENOSPC
    for name in modules:  # files that exist before the limit: writes into them fail only at wait()
        with open(os.path.join(rlimit_dir, f"{name}-existing.bin"), "wb") as f:
            f.write(bytes(1 << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))
    write_all(rlimit_dir, ["new", "existing"])
    print(json.dumps(report))
""")


def _native_available() -> bool:
    try:
        AsyncIOBuilder().jit_load()
    except (OpIncompatibleError, OpBuildError):
        return False
    return True


def _private_tmpfs(mount: Path) -> list[str] | None:
    """argv prefix that runs a command with a 512 KiB tmpfs on `mount`, or None where that is not allowed."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return None
    mount.mkdir()
    script = f"mount -t tmpfs -o size=512k tmpfs {mount}"
    if subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, check=False).returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", script + ' && exec "$@"', "sh"]


def test_full_disk_and_file_size_limit_name_the_file(tmp_path: Path) -> None:
    """A tiny private tmpfs (where mountable) gives ENOSPC, RLIMIT_FSIZE gives EFBIG: both name the file."""
    native = shutil.which("c++") is not None and _native_available()
    prefix = _private_tmpfs(tmp_path / "mnt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [*(prefix or []), sys.executable, "-c", _FULL_DISK_CHILD, str(tmp_path),
            str(tmp_path / "mnt") if prefix else "-", "1" if native else "0"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    names = ["fallback", "native"] if native else ["fallback"]
    expected = {str(tmp_path / f"{n}-{c}.bin"): (errno.EFBIG, "file size limit exceeded")
                for n in names for c in ("new", "existing")}
    if prefix:
        expected.update({str(tmp_path / "mnt" / f"{n}-new.bin"): (errno.ENOSPC, "disk full") for n in names})
    assert set(report) == set(expected)
    for path, failure in report.items():
        assert failure is not None, f"{path}: the write past the limit did not fail"
        err, filename, offset, size, text = failure
        assert (err, filename, offset, size) == (expected[path][0], path, 0, 1 << 20), failure
        assert expected[path][1] in text and f"1048576 bytes at offset 0 of '{path}'" in text, text
    existing = report[str(tmp_path / "fallback-existing.bin")][4]
    failed_at = re.search(r"at file offset (\d+)", existing)
    # failed at wait(), at or past the limit (which block fails first depends on the thread pool's timing)
    assert failed_at is not None and int(failed_at.group(1)) >= 262144, existing


def test_error_text_and_pickle() -> None:
    err = AsyncIOError(errno.ENOSPC, "write", "/nvme/x.swp", 4096, 1 << 20, "", at=8192, num_failed=3)
    text = str(err)
    assert text.startswith("async_io write of 1048576 bytes at offset 4096 of '/nvme/x.swp' failed at file "
                           "offset 8192: [Errno 28]")
    assert "(disk full)" in text and "2 more request(s)" in text
    assert isinstance(err, OSError) and err.filename == "/nvme/x.swp"
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == text and again.at == 8192


def test_wrapper_waits_on_exit_and_takes_paths(tmp_path: Path) -> None:
    src = torch.randn(3000)
    defaults = default_aio_plan()
    with AsyncIOHandle(dataclasses.replace(defaults, block_size=BLOCK), module=fallback_op) as handle:
        handle.async_pwrite(src, tmp_path / "w.bin")
        assert handle.engine == "python" and handle.alignment == 4096
        assert handle.get_queue_depth() == defaults.queue_depth  # the schema's default, defined there only
    dst = torch.empty_like(src)
    plan = AioPlan(block_size=BLOCK, queue_depth=2, single_submit=True, overlap_events=False, intra_op_parallelism=3)
    from_plan = AsyncIOHandle(plan, module=fallback_op)
    assert (from_plan.get_block_size(), from_plan.get_queue_depth(), from_plan.get_single_submit(),
            from_plan.get_overlap_events(), from_plan.get_intra_op_parallelism()) == (BLOCK, 2, True, False, 3)
    assert from_plan.sync_pread(dst, tmp_path / "w.bin") == 1
    assert torch.equal(src, dst)


def test_builder_without_libraries_uses_kernel_aio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No libaio/liburing development files (a default install): the libaio engine on raw system calls, from the
    kernel's own header, and nothing to link."""
    include, lib = tmp_path / "include", tmp_path / "lib"
    (include / "linux").mkdir(parents=True)
    lib.mkdir()
    monkeypatch.setattr(builder_mod, "search_dirs", lambda: ([str(include)], [str(lib)]))
    assert not AsyncIOBuilder().is_compatible().ok  # no kernel header either
    (include / "linux" / "aio_abi.h").write_text("")
    builder = AsyncIOBuilder()
    assert builder.is_compatible().ok and builder.extra_ldflags() == []
    assert "-DSLIPSTREAM_AIO_KERNEL_AIO" in builder.cxx_args()
    (include / "libaio.h").write_text("")
    (lib / "libaio.so").write_text("")  # the library, when present, is used instead
    assert "-DSLIPSTREAM_AIO_KERNEL_AIO" not in builder.cxx_args() and builder.extra_ldflags() == ["-laio"]


def test_builder_without_libraries_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(builder_mod, "found_libraries", lambda *a: [])
    monkeypatch.setattr(builder_mod, "has_kernel_aio", lambda *a: False)
    compat = AsyncIOBuilder().is_compatible()
    assert not compat.ok and "liburing-dev" in compat.reason and "libaio-dev" in compat.reason
    monkeypatch.setenv("SLIPSTREAM_OPS", "auto")
    monkeypatch.setattr(op_builder_mod, "_LOADED", {})
    monkeypatch.setattr(op_builder_mod, "_WARNED", set())
    monkeypatch.setattr("slipstream.git_version_info.installed_ops", {})
    with pytest.warns(RuntimeWarning, match="(?s)op 'async_io' uses its PyTorch fallback.*apt-get install liburing-dev"):
        module = AsyncIOBuilder().load()
    assert module is fallback_op


def test_builder_finds_headers_and_link_libraries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    include, lib = tmp_path / "include", tmp_path / "lib"
    include.mkdir()
    lib.mkdir()
    (include / "libaio.h").write_text("")
    assert builder_mod.found_libraries([str(include)], [str(lib)]) == []  # a header without lib*.so is not enough
    (lib / "libaio.so").write_text("")
    (include / "liburing.h").write_text("")
    assert [x.name for x in builder_mod.found_libraries([str(include)], [str(lib)])] == ["libaio"]
    monkeypatch.setattr(builder_mod, "search_dirs", lambda: ([str(include)], [str(lib)]))
    builder = AsyncIOBuilder()
    assert "-DSLIPSTREAM_AIO_HAVE_LIBAIO" in builder.cxx_args() and builder.extra_ldflags() == ["-laio"]
    assert "-DSLIPSTREAM_AIO_HAVE_URING" not in builder.cxx_args()


@pytest.mark.needs_compiler
def test_engine_choice_default_and_unknown(native_op: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_AIO_ENGINE", raising=False)
    engines = native_op.engines()
    assert engines[-1] == "sync" and native_op.aio_handle(BLOCK, 4, False, True, 1).engine() in engines
    monkeypatch.setenv("SLIPSTREAM_AIO_ENGINE", "spdk")
    with pytest.raises(RuntimeError, match="spdk: not compiled into this build"):
        native_op.aio_handle(BLOCK, 4, False, True, 1)


def test_fallback_handle_collected_on_one_of_its_own_workers_does_not_block(tmp_path: Path) -> None:
    """Garbage collection may finalize a handle in any thread, including one of its pool's workers; the
    finalizer must not join the pool there (it waited for itself and hung)."""
    import threading

    handle = fallback_op.aio_handle(block_size=4096, queue_depth=2, intra_op_parallelism=1)
    buffer = torch.arange(4096, dtype=torch.uint8)
    handle.async_pwrite(buffer, str(tmp_path / "f.bin"), 0)
    finished = threading.Event()

    def finalize_on_worker() -> None:
        handle.__del__()
        finished.set()

    handle._pool.submit(finalize_on_worker)
    assert finished.wait(timeout=20), "the handle's finalizer blocked on its own worker"
