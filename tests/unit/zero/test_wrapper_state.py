"""The ZeRO wrapper that initialize() returns forwards `state` to the optimizer it wraps, as DeepSpeed's
wrappers do (DeepSpeed's 1-bit tests read the momentum through `optimizer.state`)."""

from __future__ import annotations

import pytest
import torch

import slipstream


@pytest.mark.parametrize("stage", [0, 1])
def test_state_is_the_wrapped_optimizers(stage: int) -> None:
    model = torch.nn.Linear(4, 3)
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    config["zero_optimization"] = {"stage": stage}
    engine, *_ = slipstream.initialize(model=model, config=config)
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()
    optimizer = engine.optimizer  # the wrapper (initialize returns the basic optimizer at stage 0 in fp32)
    assert optimizer.state is engine.basic_optimizer.state
    assert [sorted(v) for v in optimizer.state.values()] == [["exp_avg", "exp_avg_sq", "step"]] * len(optimizer.state)
    assert len(optimizer.state) > 0
    engine.destroy()
