"""One training step through `slipstream.initialize` at a ZeRO stage, with plain SGD and no gradient clipping:
for tests that compare the loss and the gradients the step will use with a single-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def zero_sgd_step(model: nn.Module, *batch: torch.Tensor, stage: int) -> tuple[Any, torch.Tensor]:
    """The engine (destroy it when done) and the loss of `engine(*batch)`, after `engine.backward`."""
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": batch[0].shape[0],
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(*batch)
    engine.backward(loss)
    return engine, loss
