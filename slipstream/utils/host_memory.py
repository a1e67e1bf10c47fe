"""Freed host memory goes back to the OS at once (glibc), so NVMe offload's host memory stays at its working set.

[Note: glibc's mmap threshold]
glibc serves an allocation above its mmap threshold (128 KiB at start) with its own mapping, unmapped on free;
smaller ones come from the heap, which keeps freed memory for reuse. The threshold is dynamic: freeing a mapped
block raises it to that block's size (up to 32 MiB), so after a few frees the swap buffers, gradients and
activations of a few MiB each come from the heap, and the heap's high-water mark stays in the process's RSS.
With NVMe offload this is most of the host memory above the working set (a 200M-parameter model on one rank:
11.4 B/param of peak RSS with the dynamic threshold, 7.5 with a fixed one). `cap_mmap_threshold` fixes the
threshold at 1 MiB (which also stops the dynamic adjustment). It is called when NVMe offload or stage-3
parameter offload starts (the modes a user picks to fit a model in host memory), unless the user set
MALLOC_MMAP_THRESHOLD_ (glibc's own variable, which then rules). Elsewhere nothing is changed: every mapped
allocation costs page faults, which the in-memory paths avoid by reusing their buffers. Measured with
bench/scale.py (one rank): stage 3 with parameters and optimizer on the CPU 19.5 -> 16.4 bytes per parameter
of peak RSS (plain torch: 16.3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 20
_capped = False


def cap_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process (once); False where there is nothing to do (not
    glibc, or the user set MALLOC_MMAP_THRESHOLD_)."""
    global _capped
    if _capped:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _capped = bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    return _capped
