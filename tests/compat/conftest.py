"""Every test here runs the engine in this process, as a world of one with no launcher environment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
