"""Repo-wide pytest setup: markers (gpu, slow, needs_compiler), thread defaults and per-test seeding.

Owns the skip rules: `gpu` tests run only where torch.cuda.is_available(); `needs_compiler` tests
run only with a C++ compiler (c++ or g++ on PATH) and ninja. `slow` is registered but not skipped;
deselect it with `-m "not slow"`.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator

import pytest
import torch

_MARKERS = {
    "gpu": "needs a CUDA device; skipped unless torch.cuda.is_available()",
    "slow": "takes more than a few seconds; deselect with -m 'not slow'",
    "needs_compiler": "builds a C++ extension; skipped without c++/g++ on PATH and ninja",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    # torch is already loaded here, so this reaches only the ranks and subprocesses spawned later.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _missing_compiler() -> str | None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH; install g++ to run this test"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not available; `pip install ninja` to run this test"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="gpu test: torch.cuda.is_available() is False")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    compiler_items = [item for item in items if "needs_compiler" in item.keywords]
    reason = _missing_compiler() if compiler_items else None
    if reason is not None:
        for item in compiler_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _deterministic_seed() -> Iterator[None]:
    """Every test starts from the same RNG state, whatever ran before it."""
    torch.manual_seed(0)
    random.seed(0)
    yield
