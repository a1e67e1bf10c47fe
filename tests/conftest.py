"""Repo-wide pytest setup: markers (gpu, slow, needs_compiler), thread defaults, per-test seeding and the
random-order seed line.

Owns the skip rules: `gpu` tests run only where torch.cuda.is_available(); `needs_compiler` tests
run only with a C++ compiler (c++ or g++ on PATH) and ninja. `slow` is registered but not skipped;
deselect it with `-m "not slow"`.

`make test` shuffles the order (pytest-random-order, module buckets); the end of the run names the seed. The
plugin seeds Python's `random` once, at collection; every test reseeds `random`, numpy and torch itself
(`_deterministic_seed`), so the order changes but no test's random numbers do.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
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
    """Every test starts from the same RNG state, whatever ran before it (numpy's too, where it is installed)."""
    torch.manual_seed(0)
    random.seed(0)
    numpy = sys.modules.get("numpy")  # imported by torch when present; never imported here for nothing
    if numpy is not None:
        numpy.random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """A test that built an engine in this process (a world of one) leaves no default process group behind: the
    tests after it would see `torch.distributed.is_initialized()` True, as in a launched job."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _fresh_warn_once() -> None:
    """Every test starts with no warn_once key or config notice shown, whatever ran before it."""
    from slipstream.utils.logging import reset_once

    reset_once()


# Skipped groups and the one command that enables each (printed at the end of every run, so a machine that
# skips them says so instead of passing quietly): (group, a fragment of the skip reason, how to enable it).
_SKIP_GROUPS = (
    ("native async_io engines (io_uring, libaio)", "is not compiled in", "apt-get install liburing-dev libaio-dev"),
    ("native async_io op", "native async_io cannot be built", "apt-get install g++ liburing-dev libaio-dev"),
    ("multi-node launch over ssh", "OpenSSH", "apt-get install openssh-server openssh-client"),
    ("C++ extension builds", "C++ compiler", "apt-get install g++ && pip install ninja"),
    ("GPU tests", "gpu test", "run on a machine with a CUDA device"),
    ("interop with real DeepSpeed", "DeepSpeed peer environment absent", "bash bench/make_peer_venv.sh"),
)


def _random_order_seed(config: pytest.Config) -> str | None:
    """The seed pytest-random-order shuffled this run with, or None when the order was not shuffled."""
    seed = config.getoption("random_order_seed", None)
    bucket = config.getoption("random_order_bucket", None)
    if seed is None or bucket is None:  # the plugin is not installed
        return None
    given = [str(value) for value in (seed, bucket) if not str(value).startswith("default:")]
    if not (config.getoption("random_order_enabled", False) or given) or str(bucket).endswith("none"):
        return None
    return str(seed).removeprefix("default:")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    seed = _random_order_seed(terminalreporter.config)
    if seed is not None:
        terminalreporter.section("test order")
        terminalreporter.write_line(
            f"random order, seed {seed}; replay it with: make test TEST_SEED={seed} "
            f"(or pytest -p random_order --random-order-seed={seed} ...)"
        )
    counts: dict[int, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        for index, (_, fragment, _) in enumerate(_SKIP_GROUPS):
            if fragment in reason:
                counts[index] = counts.get(index, 0) + 1
                break
    if counts:
        terminalreporter.section("skipped groups")
        for index, count in sorted(counts.items()):
            group, _, command = _SKIP_GROUPS[index]
            terminalreporter.write_line(f"{count:4d} skipped: {group}; to run them: {command}")
