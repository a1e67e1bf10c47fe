"""`OpBuilder`: what a native op is made of, whether it can be built here, and how it is loaded.

An op is declared by a small subclass (`NAME`, `BUILD_VAR`, `FALLBACK`, `sources()`). `load()` returns,
in order of preference:
1. the module built ahead of time at install (`DS_BUILD_<OP>=1`), when the installed torch matches;
2. a just-in-time build from the shared cache (see [Note: JIT cache] in `jit.py`);
3. the pure-PyTorch fallback module, with one warning per process that names the op and the reason.

`SLIPSTREAM_OPS` chooses the policy: `auto` (default, the order above), `native` (never fall back:
raise the build error instead), `fallback` (always the PyTorch module, for tests and comparisons).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from slipstream.ops.op_builder import cpu_features, jit, toolchain
from slipstream.ops.op_builder.errors import OpBuildError, OpIncompatibleError

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
PREBUILT_PACKAGE = "slipstream.ops._prebuilt"
OPS_POLICIES = ("auto", "native", "fallback")


@dataclasses.dataclass(frozen=True)
class Compatibility:
    """Whether an op can be compiled here; `reason` says why not (and what to install)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:  # DeepSpeed's `if builder.is_compatible():`
        return self.ok


@dataclasses.dataclass(frozen=True)
class LoadedOp:
    """The module an op resolved to in this process, and how: 'prebuilt', 'jit' or 'fallback'."""

    module: ModuleType
    how: str
    reason: str = ""


# One entry per op name: the first load decides, later loads reuse it (and warn no more).
_LOADED: dict[str, LoadedOp] = {}


def ops_policy() -> str:
    """The validated value of SLIPSTREAM_OPS."""
    value = os.environ.get("SLIPSTREAM_OPS", "auto").strip().lower() or "auto"
    if value not in OPS_POLICIES:
        raise ValueError(
            f"SLIPSTREAM_OPS={value!r} is not one of {', '.join(OPS_POLICIES)}; unset it for the default 'auto'"
        )
    return value


class OpBuilder:
    """Base class of every native op. Subclasses are declarative; see `cpu_lamb.py`.

    A subclass names its op (`NAME`) and lists its sources (`SOURCES`, or a `sources()` of its own);
    `BUILD_VAR` and `FALLBACK` follow from `NAME` (`DS_BUILD_<NAME>`, `slipstream.ops.fallback.<name>`)
    unless the subclass declares them (async_io keeps DeepSpeed's `DS_BUILD_AIO`).
    """

    NAME: ClassVar[str]
    BUILD_VAR: ClassVar[str]
    FALLBACK: ClassVar[str]
    """Import path of the pure-PyTorch module with the same functions as the native one."""
    SOURCES: ClassVar[tuple[str, ...]] = ()
    """Source files, relative to `slipstream/ops/csrc` (what `sources()` returns)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("NAME")
        if name is None:
            return
        if "BUILD_VAR" not in cls.__dict__:
            cls.BUILD_VAR = f"DS_BUILD_{name.upper()}"
        if "FALLBACK" not in cls.__dict__:
            cls.FALLBACK = f"slipstream.ops.fallback.{name}"

    @property
    def name(self) -> str:
        return self.NAME

    # ---- declaration, overridden by subclasses ----
    def sources(self) -> list[str]:
        """Source files, relative to `slipstream/ops/csrc`."""
        if not self.SOURCES:
            raise NotImplementedError(f"op builder {type(self).__name__} declares no SOURCES and no sources()")
        return list(self.SOURCES)

    def include_paths(self) -> list[str]:
        """Include directories, relative to `slipstream/ops/csrc`."""
        return ["includes"]

    def cxx_args(self) -> list[str]:
        return ["-O3", "-Wno-reorder"]  # the C++ standard is the one torch's extension builder sets

    def extra_ldflags(self) -> list[str]:
        return []

    def cuda_args(self) -> list[str] | None:
        """nvcc flags, or None for an op without CUDA sources."""
        return None

    def is_compatible(self) -> Compatibility:
        """Whether this machine has what the build needs (overridden to add op-specific checks)."""
        try:
            import torch  # noqa: F401
        except ImportError:
            return Compatibility(False, "torch is not importable; install torch first")
        if toolchain.cxx_compiler() is None:
            which = (
                "cl.exe (Visual Studio Build Tools)" if sys.platform == "win32" else "a C++ compiler (g++ or clang++)"
            )
            return Compatibility(
                False, f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r}); install {which}"
            )
        return Compatibility(True)

    # ---- DeepSpeed's static queries (its tests read them at import to skip ROCm-only cases) ----
    @staticmethod
    def is_rocm_pytorch() -> bool:
        """Whether this torch is a ROCm (HIP) build and a ROCm toolkit is installed."""
        return toolchain.torch_rocm_version() != (0, 0) and toolchain.rocm_home() is not None

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """(major, minor) of the ROCm this torch was built for; (0, 0) on a CUDA or CPU build."""
        return toolchain.torch_rocm_version()

    # ---- paths ----
    def absolute_name(self) -> str:
        """Import path of the module when it was built ahead of time."""
        return f"{PREBUILT_PACKAGE}.{self.NAME}"

    def source_paths(self) -> list[Path]:
        return [CSRC_DIR / s for s in self.sources()]

    def include_dirs(self) -> list[Path]:
        return [CSRC_DIR / p for p in self.include_paths()]

    def header_paths(self) -> list[Path]:
        headers: list[Path] = []
        for directory in self.include_dirs():
            if directory.is_dir():
                headers.extend(p for p in directory.rglob("*") if p.suffix in (".h", ".hpp", ".cuh"))
        return headers

    # ---- loading ----
    def load(self, verbose: bool = False) -> ModuleType:
        """The op's module: prebuilt, JIT-built, or the fallback (one warning). DeepSpeed's `load()`."""
        cached = _LOADED.get(self.NAME)
        if cached is not None:
            return cached.module
        policy = ops_policy()
        if policy == "fallback":
            return self._use_fallback("SLIPSTREAM_OPS=fallback", warn=False)
        try:
            module, how = self._load_native(verbose=verbose)
        except (OpBuildError, OpIncompatibleError) as exc:
            if policy == "native":
                raise
            return self._use_fallback(str(exc), warn=True)
        _LOADED[self.NAME] = LoadedOp(module, how)
        return module

    def jit_load(self, verbose: bool = False) -> ModuleType:
        """Compile just in time (or reuse the cache) and import; raises OpBuildError / OpIncompatibleError."""
        compat = self.is_compatible()
        if not compat.ok:
            raise OpIncompatibleError(self.NAME, compat.reason)
        if not toolchain.ninja_path():
            raise OpIncompatibleError(self.NAME, "ninja is not installed; `pip install ninja` (JIT builds need it)")
        build_dir, module_name = self.jit_location()
        if verbose:
            print(f"slipstream: building op '{self.NAME}' in {build_dir}", file=sys.stderr)
        spec = jit.BuildSpec(
            op_name=self.NAME,
            module_name=module_name,
            build_dir=build_dir,
            sources=self.source_paths(),
            include_paths=self.include_dirs(),
            cxx_args=self.cxx_args(),
            ldflags=self.extra_ldflags(),
            cuda_args=self.cuda_args(),
        )
        return jit.build(spec)

    def jit_location(self) -> tuple[Path, str]:
        """(cache directory, module name) of this op's JIT build for the current sources and flags."""
        compiler = toolchain.cxx_compiler() or "none"
        key = jit.cache_key(
            sources=self.source_paths(),
            headers=self.header_paths(),
            flags=self.cxx_args() + self.extra_ldflags() + (self.cuda_args() or []),
            compiler_id=f"{compiler}:{toolchain.compiler_version(compiler)}",
        )
        return jit.cache_root() / f"{self.NAME}-{key}", f"slipstream_{self.NAME}_{key[:12]}"

    def jit_cached(self) -> bool:
        """Whether a finished JIT build for the current sources is in the cache (no compile needed)."""
        if not self.is_compatible().ok:
            return False
        build_dir, _ = self.jit_location()
        return (build_dir / ".complete").is_file()

    def load_status(self) -> LoadedOp | None:
        """How this op was loaded in this process, or None if it was not loaded yet."""
        return _LOADED.get(self.NAME)

    def _load_native(self, *, verbose: bool) -> tuple[ModuleType, str]:
        prebuilt = self._try_prebuilt()
        if prebuilt is not None:
            return prebuilt, "prebuilt"
        return self.jit_load(verbose=verbose), "jit"

    def _try_prebuilt(self) -> ModuleType | None:
        from slipstream.git_version_info import installed_ops, torch_info

        if not installed_ops.get(self.NAME):
            return None
        import torch

        built_with = str(torch_info.get("version", ""))
        if _major_minor(built_with) != _major_minor(torch.__version__):
            _warn_once(
                f"{self.NAME}:prebuilt",
                f"op '{self.NAME}' was built for torch {built_with} but torch {torch.__version__} "
                "is installed; compiling it again just in time (reinstall slipstream to avoid this)",
            )
            return None
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError as exc:
            _warn_once(
                f"{self.NAME}:prebuilt",
                f"prebuilt op '{self.NAME}' failed to import ({exc}); compiling it just in time",
            )
            return None

    def _use_fallback(self, reason: str, *, warn: bool) -> ModuleType:
        module = importlib.import_module(self.FALLBACK)
        if warn:
            _warn_once(
                f"{self.NAME}:fallback",
                f"op '{self.NAME}' uses its PyTorch fallback because the native build is unavailable: {reason}",
            )
        _LOADED[self.NAME] = LoadedOp(module, "fallback", reason)
        return module

    # ---- ahead-of-time build (setup.py) ----
    def setuptools_extension(self, root: Path) -> Any:
        """A torch `CppExtension` that builds this op into the wheel, paths relative to the repo `root`."""
        from torch.utils.cpp_extension import CppExtension

        def rel(path: Path) -> str:
            return os.path.relpath(path, root)

        return CppExtension(
            name=self.absolute_name(),
            sources=[rel(p) for p in self.source_paths()],
            include_dirs=[str(p) for p in self.include_dirs()],
            extra_compile_args={"cxx": self.cxx_args()},
            extra_link_args=self.extra_ldflags(),
        )


class CPUOpBuilder(OpBuilder):
    """An op for the host CPU: SIMD width and architecture from the CPU, OpenMP where the compiler has it."""

    def cxx_args(self) -> list[str]:
        compiler = toolchain.cxx_compiler()
        if sys.platform == "win32":
            return ["/O2", "/std:c++17", *(toolchain.openmp_flags(compiler)[0] if compiler else [])]
        omp = toolchain.openmp_flags(compiler)[0] if compiler else []
        return [*super().cxx_args(), *cpu_features.arch_flags(), *cpu_features.simd_flags(), *omp]

    def extra_ldflags(self) -> list[str]:
        compiler = toolchain.cxx_compiler()
        return toolchain.openmp_flags(compiler)[1] if compiler and sys.platform != "win32" else []


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"slipstream: {message}", RuntimeWarning, stacklevel=4)
