"""The engine's weight hand-off, mixed into the engine: `iter_full_weights()` (whole parameters a bucket at a
time, zero/full_weights.py)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from slipstream.zero.full_weights import DEFAULT_BUCKET_BYTES, iter_full_weights
from slipstream.zero.stage3.model import ZeroModel


class WeightHandOff:
    """Attributes it reads are the engine's."""

    module: nn.Module
    zero_model: ZeroModel | None

    def iter_full_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole value) of every parameter, as `module.named_parameters()` names them; at ZeRO-3 gathered
        `bucket_bytes` of units at a time (collective: every rank iterates to the end). The values stay valid
        while kept; at stages 0-2 they are the live parameters, changed by the next step."""
        return iter_full_weights(self.module, self.zero_model, bucket_bytes=bucket_bytes)
