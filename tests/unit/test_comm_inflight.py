"""`inflight.settle`: after a wait on a completed collective of 1 MiB or more, the backend's worker is given a
moment to drop its reference to the collective's tensors, so the caller's buffers are freed when the caller drops
them. A second C++ reference (an autograd node saving the alias) stands in for gloo's worker, and a fake clock
stands in for `time`: the tests count the polls settle makes, never the wall time they take."""

from __future__ import annotations

import sys

import pytest
import torch

from slipstream.comm import inflight


def _held(alias: torch.Tensor) -> list[torch.Tensor]:
    """A list whose element keeps a C++ reference to `alias` (its autograd node saves it) until cleared."""
    return [torch.ones(1, requires_grad=True) * alias]


class FakeClock:
    """`time` for inflight: each sleep advances the clock by its argument; `release` runs after `release_after`
    sleeps (the worker letting go). More than `max_sleeps` sleeps fail the test instead of spinning forever."""

    def __init__(self, release: list[torch.Tensor] | None = None, *, release_after: int = 0,
                 max_sleeps: int = 10_000) -> None:
        self.now, self.sleeps = 0.0, 0
        self.release, self.release_after, self.max_sleeps = release, release_after, max_sleeps

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if self.sleeps > self.max_sleeps:
            raise AssertionError(f"settle slept {self.sleeps} times (clock {self.now} s) without returning")
        if self.release is not None and self.sleeps == self.release_after:
            self.release.clear()


def test_settle_waits_until_the_worker_lets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inflight, "_SETTLE_S", 5.0)
    entry = inflight.Handed((torch.zeros(1 << 19),), "test 2 MiB")
    holder = _held(entry.aliases[0])
    clock = FakeClock(holder, release_after=3)
    monkeypatch.setattr(inflight, "time", clock)
    assert not entry.released()
    inflight.settle(entry)
    assert entry.released()
    assert clock.sleeps == 3  # returned at the first poll after the reference went, not at the limit


def test_settle_is_bounded_and_skips_small_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inflight, "_SETTLE_S", 0.05)
    large = inflight.Handed((torch.zeros(1 << 19),), "test 2 MiB")
    held_large = _held(large.aliases[0])
    clock = FakeClock()
    monkeypatch.setattr(inflight, "time", clock)
    inflight.settle(large)  # the reference never goes: gives up at the limit
    assert not large.released()
    polls = round(0.05 / inflight._SETTLE_POLL_S)
    assert polls <= clock.sleeps <= polls + 1 and clock.now >= 0.05

    monkeypatch.setattr(inflight, "_SETTLE_S", 5.0)
    small = inflight.Handed((torch.zeros(1024),), "test 4 KiB")
    held_small = _held(small.aliases[0])
    clock = FakeClock()
    monkeypatch.setattr(inflight, "time", clock)
    inflight.settle(small)  # not worth a wait: the next collective's prune finds it
    assert clock.sleeps == 0 and not small.released()
    held_large.clear()
    held_small.clear()
    assert large.released() and small.released()


def _cxx_references_the_python_object() -> bool:
    """Whether this torch adds a reference to a tensor's Python object while C++ holds the tensor too (2.13 does;
    older releases keep the object alive from C++ only once Python let go)."""
    alias = torch.zeros(1)
    before = sys.getrefcount(alias)
    holder = _held(alias)
    after = sys.getrefcount(alias)
    holder.clear()
    return after > before


def test_not_released_until_the_python_object_is_handed_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker drops its C++ reference first and hands the Python object back after; a worker preempted
    between the two looks done by the count alone, and drops the object later, past the drain at exit."""
    if not _cxx_references_the_python_object():
        pytest.skip("this torch does not reference a tensor's Python object from C++")
    entry = inflight.Handed((torch.zeros(8),), "test")
    holder = _held(entry.aliases[0])
    monkeypatch.setattr(inflight, "use_count", lambda tensor: 1)  # the count already says done
    assert not entry.released()
    holder.clear()
    assert entry.released()
