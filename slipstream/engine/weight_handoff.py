"""The engine's weight hand-off, mixed into the engine: `iter_full_weights()` (whole parameters a bucket at a
time, zero/full_weights.py) and `generate()` (the hybrid engine's: at ZeRO-3 with `hybrid_engine.enabled` the
whole model is gathered once per call, generated from with the model's own KV cache, and released after)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from slipstream.config.plan import EnginePlan
from slipstream.zero.full_weights import DEFAULT_BUCKET_BYTES, iter_full_weights
from slipstream.zero.gathered import unwrap_model_for_generation
from slipstream.zero.stage3.model import ZeroModel


class WeightHandOff:
    """Attributes it reads are the engine's."""

    module: nn.Module
    zero_model: ZeroModel | None
    plan: EnginePlan

    def iter_full_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole value) of every parameter, as `module.named_parameters()` names them; at ZeRO-3 gathered
        `bucket_bytes` of units at a time (collective: every rank iterates to the end). The values stay valid
        while kept; at stages 0-2 they are the live parameters, changed by the next step."""
        return iter_full_weights(self.module, self.zero_model, bucket_bytes=bucket_bytes)

    def generate(self, *inputs: object, **kwargs: object) -> object:
        """The model's `generate`. With `hybrid_engine.enabled` at ZeRO-3 the units are gathered once for the whole
        call (not per layer and token by the module hooks) and released when it returns; without it, or below
        stage 3, the model's `generate` runs as it is."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise AttributeError(
                f"engine.generate(): {type(self.module).__name__} has no generate(); call the engine for its forward"
            )
        if not self.plan.hybrid_generate or self.zero_model is None:
            return generate(*inputs, **kwargs)
        with unwrap_model_for_generation(self.module):
            return generate(*inputs, **kwargs)
