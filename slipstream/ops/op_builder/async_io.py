"""The `async_io` op: asynchronous, parallel tensor reads and writes to files for NVMe offload (DS_BUILD_AIO).

The native op drives libaio or io_uring (liburing), whichever development files are installed (both when
both are; libaio is preferred at run time), and falls back to a pread/pwrite thread pool when the kernel
refuses them. The
builder finds the headers and the `lib*.so` link names in the usual directories (plus CPATH,
C_INCLUDE_PATH, CPLUS_INCLUDE_PATH and LIBRARY_PATH, which the compiler also searches). Without libaio's
development files, its engine is built on the kernel's AIO system calls directly (`linux/aio_abi.h`, part of
the kernel headers every Linux toolchain has), so a default install gets native asynchronous I/O; only
without those headers too is the op incompatible, and the reason names the packages to install.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import sysconfig

from slipstream.ops.op_builder.builder import Compatibility, OpBuilder


@dataclasses.dataclass(frozen=True)
class AioLibrary:
    """A kernel async-I/O library: its header, link name, compile define and the packages that provide it."""

    name: str
    header: str
    link_name: str
    define: str
    debian: str
    fedora: str


LIBRARIES = (
    AioLibrary("liburing", "liburing.h", "uring", "SLIPSTREAM_AIO_HAVE_URING", "liburing-dev", "liburing-devel"),
    AioLibrary("libaio", "libaio.h", "aio", "SLIPSTREAM_AIO_HAVE_LIBAIO", "libaio-dev", "libaio-devel"),
)


def _env_dirs(*names: str) -> list[str]:
    return [d for name in names for d in os.environ.get(name, "").split(os.pathsep) if d]


def search_dirs() -> tuple[list[str], list[str]]:
    """(include directories, library directories) searched for the libraries' development files."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    includes = [*_env_dirs("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH"), "/usr/local/include", "/usr/include"]
    libs = [
        *_env_dirs("LIBRARY_PATH"),
        "/usr/local/lib",
        "/usr/local/lib64",
        "/usr/lib64",
        "/usr/lib",
        "/lib64",
        "/lib",
    ]
    if multiarch:
        includes.append(f"/usr/include/{multiarch}")
        libs[1:1] = [f"/usr/local/lib/{multiarch}", f"/usr/lib/{multiarch}", f"/lib/{multiarch}"]
    else:
        libs.extend(sorted(glob.glob("/usr/lib/*-linux-gnu*")))
    return includes, libs


def found_libraries(includes: list[str] | None = None, libs: list[str] | None = None) -> list[AioLibrary]:
    """The libraries whose header and `lib<name>.so` (the development link) are both present."""
    if includes is None or libs is None:
        includes, libs = search_dirs()
    found = []
    for lib in LIBRARIES:
        has_header = any(os.path.isfile(os.path.join(d, lib.header)) for d in includes)
        has_link = any(os.path.exists(os.path.join(d, f"lib{lib.link_name}.so")) for d in libs)
        if has_header and has_link:
            found.append(lib)
    return found


KERNEL_AIO_HEADER = "linux/aio_abi.h"
KERNEL_AIO_DEFINE = "SLIPSTREAM_AIO_KERNEL_AIO"


def has_kernel_aio(includes: list[str] | None = None) -> bool:
    """Whether the kernel's AIO ABI header is there (the "libaio" engine on raw system calls needs only it)."""
    if includes is None:
        includes = search_dirs()[0]
    return any(os.path.isfile(os.path.join(d, KERNEL_AIO_HEADER)) for d in includes)


def missing_reason() -> str:
    """Why the op cannot be built without either library, and what to install."""
    return (
        f"neither liburing nor libaio development files nor the kernel's {KERNEL_AIO_HEADER} were found "
        "(liburing.h + liburing.so, or libaio.h + libaio.so); install one: `apt-get install liburing-dev` or `apt-get install libaio-dev` "
        "(Debian/Ubuntu), `dnf install liburing-devel` or `libaio-devel` (Fedora/RHEL); if it is installed "
        "elsewhere, add its include directory to CPATH and its lib directory to LIBRARY_PATH"
    )


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"
    SOURCES = ("aio/aio_py.cpp", "aio/aio_engine.cpp", "aio/aio_rings.cpp")

    def include_paths(self) -> list[str]:
        return ["aio"]

    def cxx_args(self) -> list[str]:
        libraries = found_libraries()
        defines = [lib.define for lib in libraries]
        if not any(lib.name == "libaio" for lib in libraries) and has_kernel_aio():
            defines.append(KERNEL_AIO_DEFINE)
        return [*super().cxx_args(), *(f"-D{define}" for define in defines)]

    def extra_ldflags(self) -> list[str]:
        return [f"-l{lib.link_name}" for lib in found_libraries()]

    def is_compatible(self) -> Compatibility:
        if not sys.platform.startswith("linux"):
            return Compatibility(False, f"async_io needs Linux (io_uring or libaio); this is {sys.platform}")
        base = super().is_compatible()
        if not base.ok:
            return base
        if not found_libraries() and not has_kernel_aio():
            return Compatibility(False, missing_reason())
        return Compatibility(True)
