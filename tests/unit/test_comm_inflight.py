"""`inflight.settle`: after a wait on a completed collective of 1 MiB or more, the backend's worker is given a
moment to drop its reference to the collective's tensors, so the caller's buffers are freed when the caller drops
them. A second C++ reference (an autograd node saving the alias) stands in for gloo's worker."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slipstream.comm import inflight


def _held(alias: torch.Tensor) -> list[torch.Tensor]:
    """A list whose element keeps a C++ reference to `alias` (its autograd node saves it) until cleared."""
    return [torch.ones(1, requires_grad=True) * alias]


def test_settle_waits_until_the_worker_lets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inflight, "_SETTLE_S", 5.0)  # generous: a loaded machine may start the timer late
    entry = inflight.Handed((torch.zeros(1 << 19),), "test 2 MiB")
    holder = _held(entry.aliases[0])
    assert not entry.released()
    threading.Timer(0.01, holder.clear).start()
    started = time.monotonic()
    inflight.settle(entry)
    assert entry.released()
    assert time.monotonic() - started < 4.0  # returned when the reference went, not at the limit


def test_settle_is_bounded_and_skips_small_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inflight, "_SETTLE_S", 0.05)
    large = inflight.Handed((torch.zeros(1 << 19),), "test 2 MiB")
    held_large = _held(large.aliases[0])
    started = time.monotonic()
    inflight.settle(large)  # the reference never goes: gives up after the limit
    assert 0.05 <= time.monotonic() - started < 2.0 and not large.released()

    monkeypatch.setattr(inflight, "_SETTLE_S", 5.0)
    small = inflight.Handed((torch.zeros(1024),), "test 4 KiB")
    held_small = _held(small.aliases[0])
    started = time.monotonic()
    inflight.settle(small)  # not worth a wait: the next collective's prune finds it
    assert time.monotonic() - started < 1.0 and not small.released()
    held_large.clear()
    held_small.clear()
    assert large.released() and small.released()
