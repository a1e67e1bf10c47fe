"""Subtest grids run inside one spawned rank (FSDP2's `run_subtests` pattern), so a grid costs one spawn.

Owns `subtest_grid` and `run_subtests`. Typical use inside a rank function::

    def _check_bucketing(rank: int, world_size: int) -> None:
        cases = subtest_grid(bucket_size=[7, 64], dtype=[torch.float32, torch.bfloat16])
        run_subtests(cases, functools.partial(_check_one_bucketing, rank=rank))

    def test_bucketing() -> None:
        run_distributed(_check_bucketing, world_size=2)

Every rank must run the same cases in the same order, or the collectives inside them mismatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


class SubtestError(AssertionError):
    """One case of a `run_subtests` grid failed; the message names the case, the cause is chained."""


def subtest_grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Cartesian product of keyword axes: subtest_grid(a=[1, 2], b=[3]) -> [{'a': 1, 'b': 3}, {'a': 2, 'b': 3}]."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def run_subtests(cases: Iterable[Mapping[str, Any]], fn: Callable[..., Any]) -> list[Any]:
    """Run `fn(**case)` for each case in order and return the results.

    The first failing case raises SubtestError("subtest i/n failed for case {...}: <cause>") chained
    to the original exception; pytest.skip inside a case is not caught and skips the whole run.
    """
    cases = list(cases)
    results = []
    for i, case in enumerate(cases):
        try:
            results.append(fn(**case))
        except Exception as exc:
            raise SubtestError(f"subtest {i + 1}/{len(cases)} failed for case {dict(case)!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
    return results
