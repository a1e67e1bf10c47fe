"""Just-in-time compilation of native ops into a content-keyed cache that several processes can share.

[Note: JIT cache]
- The cache directory of an op is `<root>/<op>-<key>`, where the key hashes the sources and headers, the
  compiler flags, the compiler, the torch and Python versions. A changed source gets a new directory, so
  nothing stale is ever loaded, and a second process finds a finished build and imports it directly
  (no ninja run), in milliseconds.
- A finished build is marked by a `.complete` file written after the module imported successfully.
- Builders of the same op serialize on an OS file lock (`flock` / `msvcrt.locking`) held on
  `<root>/<op>-<key>.lock`. The kernel drops it when its holder dies, so a build killed half way never
  leaves a lock that blocks the next one. torch's own `lock` file inside the build directory, which a
  killed build does leave behind, goes with the wiped directory (next point).
- A build directory without `.complete`, found while holding the lock, is what a failed or killed build
  left behind (a truncated module, torch's stale `lock` file): it is wiped and built from scratch.
- Root: `SLIPSTREAM_OPS_CACHE`, else `TORCH_EXTENSIONS_DIR/slipstream` (DeepSpeed's variable), else
  `~/.cache/slipstream/ops`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from slipstream.ops.op_builder.errors import OpBuildError, first_error_lines

_LOCK_POLL_S = 0.2
# Builds that failed in this process, by directory: the error is raised again instead of rebuilding.
_FAILED_BUILDS: dict[Path, OpBuildError] = {}
_LOCK_NOTICE_S = 30.0


def cache_root() -> Path:
    """Directory that holds every JIT-built op of this user."""
    explicit = os.environ.get("SLIPSTREAM_OPS_CACHE")
    if explicit:
        return Path(explicit)
    torch_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
    if torch_dir:
        return Path(torch_dir) / "slipstream"
    return Path.home() / ".cache" / "slipstream" / "ops"


def cache_key(*, sources: list[Path], headers: list[Path], flags: list[str], compiler_id: str) -> str:
    """Hash of everything that changes the built module (see [Note: JIT cache])."""
    import torch

    digest = hashlib.sha256()
    for path in [*sources, *sorted(headers)]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for part in (*flags, compiler_id, torch.__version__, platform.machine(), f"py{sys.version_info[:2]}"):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, *, what: str) -> Iterator[None]:
    """Hold an OS-level exclusive lock on `lock_path`; released by the kernel if this process dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(lock_path, "a+b")
    started = time.monotonic()
    noticed = False
    try:
        while not _try_lock(handle):
            if not noticed and time.monotonic() - started > _LOCK_NOTICE_S:
                print(f"slipstream: waiting for another process that is building {what} ({lock_path})", file=sys.stderr)
                noticed = True
            time.sleep(_LOCK_POLL_S)
        yield
    finally:
        _unlock(handle)
        handle.close()


def _try_lock(handle: object) -> bool:
    if sys.platform == "win32":
        import msvcrt

        try:
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[attr-defined]
    except BlockingIOError:
        return False
    return True


def _unlock(handle: object) -> None:
    if sys.platform == "win32":
        import msvcrt

        with contextlib.suppress(OSError):
            msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]
        return
    import fcntl

    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)  # type: ignore[attr-defined]


def _module_file(build_dir: Path, module_name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES + [".so", ".pyd"]:
        candidate = build_dir / f"{module_name}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def import_built(build_dir: Path, module_name: str) -> ModuleType | None:
    """Import a finished build from the cache, or None when there is none."""
    if not (build_dir / ".complete").is_file():
        return None
    path = _module_file(build_dir, module_name)
    if path is None:
        return None
    if module_name in sys.modules:
        return sys.modules[module_name]
    import torch  # noqa: F401  (the extension links against libtorch, which must be loaded first)

    loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    if spec is None:
        return None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[module_name] = module
    return module


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """What one op's JIT build compiles: its sources and flags, and where the module goes."""

    op_name: str
    module_name: str
    build_dir: Path
    sources: list[Path]
    include_paths: list[Path]
    cxx_args: list[str]
    ldflags: list[str]
    cuda_args: list[str] | None = None
    """None: a CPU-only op (no CUDA compiler is run)."""


def build(spec: BuildSpec) -> ModuleType:
    """Compile (or reuse) the op under the cache lock and import it; raises OpBuildError on failure."""
    build_dir, module_name = spec.build_dir, spec.module_name
    built = import_built(build_dir, module_name)
    if built is not None:
        return built
    with exclusive_lock(build_dir.with_name(build_dir.name + ".lock"), what=f"op '{spec.op_name}'"):
        built = import_built(build_dir, module_name)  # another process may have finished meanwhile
        if built is not None:
            return built
        failed = _FAILED_BUILDS.get(build_dir)
        if failed is not None:
            raise failed  # torch would not retry the same sources in this process; neither do we
        # No `.complete` while we hold the lock: whatever is here is what a failed or killed build left.
        shutil.rmtree(build_dir, ignore_errors=True)
        build_dir.mkdir(parents=True)
        try:
            module = _compile(spec)
        except OpBuildError as exc:
            _FAILED_BUILDS[build_dir] = exc
            raise
        sys.modules.setdefault(module_name, module)
        (build_dir / ".complete").write_text(module_name + "\n")
        return module


def _compile(spec: BuildSpec) -> ModuleType:
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name=spec.module_name,
            sources=[str(s) for s in spec.sources],
            extra_include_paths=[str(p) for p in spec.include_paths],
            extra_cflags=spec.cxx_args,
            extra_ldflags=spec.ldflags,
            extra_cuda_cflags=spec.cuda_args,
            build_directory=str(spec.build_dir),
            with_cuda=spec.cuda_args is not None,
            verbose=False,
        )
    except (RuntimeError, OSError, SystemError, ImportError) as exc:
        raise OpBuildError(
            spec.op_name,
            _ninja_command(spec.build_dir),
            first_error_lines(str(exc)),
            hint="set SLIPSTREAM_OPS=fallback to skip native ops",
        ) from exc


def _ninja_command(build_dir: Path) -> str:
    """The compile command recorded in build.ninja, as a reader would type it."""
    ninja_file = build_dir / "build.ninja"
    if not ninja_file.is_file():
        return ""
    text = ninja_file.read_text(errors="replace")
    variables = dict(re.findall(r"^(\w+) = (.*)$", text, flags=re.MULTILINE))
    parts = [variables.get("cxx", "c++"), variables.get("cflags", ""), variables.get("post_cflags", "")]
    return " ".join(p for p in parts if p).strip()
