"""The engine getters Transformers and Accelerate call (compat/engine_getters.py), on a one-process engine: each
answers from the config it was given (Accelerate's get_state_dict asks zero_gather_16bit_weights_on_model_save)."""

from __future__ import annotations

import pytest

import slipstream
from tests.harness.models import TinyMLP


@pytest.mark.parametrize("stage, gather", [(0, None), (3, False), (3, True)])
def test_gather_16bit_weights_on_model_save(stage: int, gather: bool | None) -> None:
    zero: dict = {"stage": stage}
    if gather is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = gather
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    try:
        assert engine.zero_gather_16bit_weights_on_model_save() is bool(gather)
        assert engine.zero_optimization_stage() == stage
        assert engine.zero_optimization_partition_weights() is (stage == 3)
    finally:
        engine.destroy()
