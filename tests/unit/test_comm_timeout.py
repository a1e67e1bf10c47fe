"""Which timeout a collective gets: the config's, then init_distributed's, then SLIPSTREAM_TIMEOUT, then
DEEPSPEED_TIMEOUT (minutes), then 5 minutes; and how the config's is read ahead of resolve()."""

from __future__ import annotations

import datetime

import pytest

from slipstream.comm import collectives
from slipstream.config import collective_timeout_of


@pytest.fixture(autouse=True)
def _no_chosen_timeout(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("SLIPSTREAM_TIMEOUT", raising=False)
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    collectives.set_collective_timeout(None)
    yield
    collectives.set_collective_timeout(None)


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert collectives.collective_timeout() == datetime.timedelta(minutes=5)
    assert collectives.configured_timeout() is None
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "2")
    assert collectives.collective_timeout() == datetime.timedelta(minutes=2)
    monkeypatch.setenv("SLIPSTREAM_TIMEOUT", "7")
    assert collectives.collective_timeout() == datetime.timedelta(seconds=7)
    collectives.set_collective_timeout(3)
    assert collectives.collective_timeout() == datetime.timedelta(seconds=3)


def test_the_config_timeout_is_read_before_resolve() -> None:
    assert collective_timeout_of({"collective_timeout": 10}) == 10.0
    assert collective_timeout_of({}) is None
    for bad in ("10", True, 0, -1):  # resolve() reports these with the key and the fix
        assert collective_timeout_of({"collective_timeout": bad}) is None
