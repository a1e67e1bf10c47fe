"""`StagingRing`: the reusable buffers of gradient reduce-scatters launched during backward (stages 2 and 3).

Two staging buffers (the packed gradients, rank-major) and two receive buffers (this rank's summed piece) are
allocated once, for the largest reduction, and used in turn. Taking a slot first completes the reduction
that used it last: it waits for the collective and hands the received piece to that reduction's `deliver`
(which adds it into the owned gradient storage). So at most two reductions are in flight, and buffers are
never re-allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_NUM_SLOTS = 2


class StagingRing:
    def __init__(
        self, *, staging_numel: int, receive_numel: int, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        self.staging = [torch.zeros(staging_numel, dtype=dtype, device=device) for _ in range(_NUM_SLOTS)]
        self.receive = [torch.zeros(receive_numel, dtype=dtype, device=device) for _ in range(_NUM_SLOTS)]
        self._in_flight: dict[int, tuple[Any, torch.Tensor, Callable[[torch.Tensor], Any]]] = {}
        self._turn = 0

    def take(self, staging_numel: int, receive_numel: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The next slot (its previous reduction completed) and its staging and receive views."""
        slot = self._turn % _NUM_SLOTS
        self._turn += 1
        self._finish(slot)
        return slot, self.staging[slot][:staging_numel], self.receive[slot][:receive_numel]

    def launched(
        self, slot: int, work: object, receive: torch.Tensor, deliver: Callable[[torch.Tensor], object]
    ) -> None:
        """`work` (None when already complete) fills `receive`; `deliver(receive)` runs once it has."""
        self._in_flight[slot] = (work, receive, deliver)

    def _finish(self, slot: int) -> None:
        entry = self._in_flight.pop(slot, None)
        if entry is None:
            return
        work, receive, deliver = entry
        if work is not None:
            work.wait()
        deliver(receive)

    def finish_all(self) -> None:
        for slot in list(self._in_flight):
            self._finish(slot)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.staging, *self.receive])
