"""`OwnedSlice`: one rank's part of one parameter, as checkpoints see it (global flat range + where it lives).

Every ZeRO stage answers the same question for save and load: for each parameter, which flat range
[lo, hi) of the global tensor does this rank hold, and in which tensors (the fp32 master, the model-dtype
values, the optimizer state slices at `piece_offset` of the optimizer's `piece`, the owned gradient)? The checkpoint code
(slipstream/checkpoint/) reads and writes through these views only, so it never depends on a stage's layout.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class OwnedSlice:
    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    value: torch.Tensor
    """The model-dtype values of [lo, hi) (a view: writing it changes the parameter or its shard)."""
    master: torch.Tensor | None = None
    """The fp32 master values of [lo, hi) (a view), or None for frozen parameters / no optimizer, and with NVMe
    offload outside the optimizer's `resident_state()` (the masters are in files then)."""
    piece: torch.Tensor | None = None
    """The tensor the wrapped optimizer steps (its state is keyed by it), and where [lo, hi) starts in it."""
    piece_offset: int = 0
    group_index: int = 0
    grad: torch.Tensor | None = None
    """The summed (not yet averaged) gradient of [lo, hi) in the owned grad storage (a view), where the
    optimizer's `settle_gradients()` leaves it before the step; None for frozen parameters, and at ZeRO-3 with
    NVMe offload outside the optimizer's `gradients_resident()` (the gradients are in files then)."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def state_view(self, state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        return state[key][self.piece_offset : self.piece_offset + self.numel]
