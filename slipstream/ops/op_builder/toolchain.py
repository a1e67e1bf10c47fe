"""The build tools on this machine: C++ compiler, ninja, OpenMP, and the CUDA or ROCm toolkit.

Every probe runs commands as argv lists with a timeout and caches its answer for the process.
`CXX`, `CUDA_HOME` and `ROCM_HOME` are honoured as torch's extension builder honours them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(argv: list[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None


def cxx_compiler() -> str | None:
    """Path of the C++ compiler torch's extension builder will use, or None when there is none."""
    if sys.platform == "win32":
        return shutil.which("cl")
    candidate = os.environ.get("CXX", "c++")
    return shutil.which(candidate)


@functools.cache
def compiler_version(compiler: str) -> str:
    """First line of `<compiler> --version`, or 'unknown'."""
    result = _run([compiler, "--version"], timeout=10)
    if result is None or result.returncode != 0 or not result.stdout.strip():
        return "unknown"
    return result.stdout.strip().splitlines()[0]


def ninja_path() -> str | None:
    """Path of ninja (from PATH or the `ninja` package's scripts directory)."""
    found = shutil.which("ninja")
    if found:
        return found
    scripts = Path(sys.executable).parent / ("ninja.exe" if sys.platform == "win32" else "ninja")
    return str(scripts) if scripts.is_file() else None


@functools.cache
def ninja_version() -> str | None:
    path = ninja_path()
    if path is None:
        return None
    result = _run([path, "--version"], timeout=10)
    return result.stdout.strip() if result is not None and result.returncode == 0 else None


@functools.cache
def openmp_flags(compiler: str) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) that enable OpenMP with this compiler; empty when it has none (Apple clang).

    The answer comes from compiling a probe once per compiler; it is remembered in the JIT cache so later
    processes do not pay for the probe.
    """
    if sys.platform == "win32":
        return (["/openmp"], [])
    from slipstream.ops.op_builder.jit import cache_root

    key = hashlib.sha256(f"{compiler}:{compiler_version(compiler)}".encode()).hexdigest()[:16]
    memo = cache_root() / "probes" / f"openmp-{key}"
    if memo.is_file():
        has_openmp = memo.read_text().strip() == "1"
    else:
        has_openmp = _probe_openmp(compiler)
        with contextlib.suppress(OSError):
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text("1" if has_openmp else "0")
    return (["-fopenmp"], ["-fopenmp"]) if has_openmp else ([], [])


def _probe_openmp(compiler: str) -> bool:
    source = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    with tempfile.TemporaryDirectory(prefix="slipstream-omp-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(source)
        result = _run([compiler, "-fopenmp", str(src), "-o", str(Path(tmp) / "probe")], timeout=60)
    return result is not None and result.returncode == 0


def cuda_home() -> str | None:
    """The CUDA toolkit root: CUDA_HOME / CUDA_PATH, else the directory above `nvcc` on PATH."""
    for key in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(key)
        if value and Path(value).is_dir():
            return value
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    default = Path("/usr/local/cuda")
    return str(default) if default.is_dir() else None


def rocm_home() -> str | None:
    """The ROCm root: ROCM_HOME / ROCM_PATH, else /opt/rocm when present."""
    for key in ("ROCM_HOME", "ROCM_PATH"):
        value = os.environ.get(key)
        if value and Path(value).is_dir():
            return value
    return "/opt/rocm" if Path("/opt/rocm").is_dir() else None


def torch_rocm_version() -> tuple[int, int]:
    """(major, minor) of the ROCm (HIP) this torch was built for; (0, 0) for a CUDA or CPU build."""
    import torch

    match = re.match(r"(\d+)\.(\d+)", getattr(torch.version, "hip", None) or "")
    return (int(match[1]), int(match[2])) if match else (0, 0)


@functools.cache
def nvcc_version(home: str | None) -> str | None:
    """'major.minor' of the nvcc under `home`, or None."""
    if home is None:
        return None
    nvcc = Path(home) / "bin" / ("nvcc.exe" if sys.platform == "win32" else "nvcc")
    if not nvcc.is_file():
        return None
    result = _run([str(nvcc), "--version"], timeout=20)
    if result is None:
        return None
    match = re.search(r"release (\d+\.\d+)", result.stdout)
    return match.group(1) if match else None


def cuda_arch_flags(arch_list: str | None = None) -> list[str]:
    """nvcc -gencode flags from TORCH_CUDA_ARCH_LIST ('8.0;9.0+PTX'); empty means torch's own default."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if arch_list is None else arch_list
    flags: list[str] = []
    for item in re.split(r"[;\s]+", arch_list.strip()):
        if not item:
            continue
        ptx = item.endswith("+PTX")
        number = item.removesuffix("+PTX")
        if not re.fullmatch(r"\d+\.\d+[af]?", number):
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST entry {item!r} is not a compute capability; "
                "use entries like '8.0', '9.0' or '9.0+PTX' separated by ';'"
            )
        digits = number.replace(".", "")
        flags.append(f"-gencode=arch=compute_{digits},code=sm_{digits}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{digits},code=compute_{digits}")
    return flags
