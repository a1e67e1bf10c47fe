"""RNG states captured per piece of a forward and restored for its recompute (tiled compute, chunked attention)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["RngStates"]


class RngStates:
    """The RNG states before each piece of a forward (a tiled slice, a head chunk), restored for that piece's
    recompute in backward, so dropout draws the same masks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = getattr(torch, device.type, None) if device.type != "cpu" else None
        self.states: list[tuple[torch.Tensor, Any]] = []

    def record(self) -> None:
        device_state = self.module.get_rng_state(self.device) if self.module is not None else None
        self.states.append((torch.get_rng_state(), device_state))

    @contextmanager
    def restored(self, index: int) -> Iterator[None]:
        cpu_state, device_state = self.states[index]
        forked = [self.device] if device_state is not None else []
        with torch.random.fork_rng(devices=forked, device_type=self.device.type):
            torch.set_rng_state(cpu_state)
            if device_state is not None and self.module is not None:
                self.module.set_rng_state(device_state, self.device)
            yield
