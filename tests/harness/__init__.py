"""Test harness for Slipstream: multi-process gloo runner, tiny models and the single-process reference."""

from __future__ import annotations

from tests.harness.dist import DistributedTestError, DistributedTimeoutError, distributed, run_distributed
from tests.harness.subtests import SubtestError, run_subtests, subtest_grid

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "SubtestError",
    "distributed",
    "run_distributed",
    "run_subtests",
    "subtest_grid",
]
