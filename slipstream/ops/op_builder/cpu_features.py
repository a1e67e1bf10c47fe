"""What the host CPU can do, and the compiler flags that follow from it (SIMD width, architecture, OpenMP).

Read from `/proc/cpuinfo` on Linux and `sysctl` on macOS; no third-party dependency. The environment
variable `SLIPSTREAM_CPU_ARCH` replaces the architecture flag (for example `-march=x86-64-v3` when an
ahead-of-time build must run on other machines than the one that built it).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys

SIMD_DEFINES = {"avx512": "-D__AVX512__", "avx2": "-D__AVX256__", "neon": "-D__NEON__", "scalar": "-D__SCALAR__"}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """Lower-case CPU feature names of this host (empty when they cannot be read)."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
                for line in handle:
                    if line.startswith(("flags", "Features")):
                        return frozenset(line.split(":", 1)[1].lower().split())
        except OSError:
            return frozenset()
    if sys.platform == "darwin":
        keys = ["machdep.cpu.features", "machdep.cpu.leaf7_features"]
        try:
            out = subprocess.run(["sysctl", "-n", *keys], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return frozenset()
        return frozenset(out.lower().replace(".", "_").split())
    return frozenset()


def simd_level(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The widest SIMD family the kernels use here: 'avx512', 'avx2', 'neon' or 'scalar'."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    if machine in ("arm64", "aarch64"):
        return "neon"
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "scalar"


def arch_flags(machine: str | None = None) -> list[str]:
    """The compiler's architecture flag: native code for this host unless SLIPSTREAM_CPU_ARCH says otherwise."""
    override = os.environ.get("SLIPSTREAM_CPU_ARCH")
    if override is not None:
        return override.split()
    if sys.platform == "win32":
        return []
    machine = (machine or platform.machine()).lower()
    if machine in ("arm64", "aarch64"):
        return ["-mcpu=native"]
    if machine.startswith(("ppc", "powerpc")):
        return ["-mcpu=native"]
    if machine.startswith("riscv"):
        return ["-march=rv64gc"]
    return ["-march=native"]


def simd_flags() -> list[str]:
    """The -D flag the kernels read to choose their vector path."""
    if os.environ.get("SLIPSTREAM_CPU_ARCH") is not None:
        # A portable target was asked for: let the compiler's own macros (__AVX2__, ...) decide.
        return []
    return [SIMD_DEFINES[simd_level()]]
