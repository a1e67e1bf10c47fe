"""Progressive layer drop at DeepSpeed's import path (`deepspeed.runtime.progressive_layer_drop`): DeepSpeed's
constructor, and keep probabilities that are the same bits as DeepSpeed's numpy formula."""

from __future__ import annotations

import numpy as np
import pytest

import slipstream  # noqa: F401  (DeepSpeed's module paths)


@pytest.mark.parametrize("theta", [0.0, 0.1, 0.9, 1.0])
def test_theta_is_deepspeeds_formula_bit_for_bit(theta: float) -> None:
    from slipstream.runtime.progressive_layer_drop import ProgressiveLayerDrop

    gamma = 0.001
    schedule = ProgressiveLayerDrop(theta, gamma)
    assert schedule.get_theta() == 1.0
    for step in range(300):
        schedule.update_state(step)
        assert schedule.get_theta() == (1.0 - theta) * np.exp(-gamma * step) + theta, step
    assert schedule.get_state() == {"progressive_layer_drop": True, "pld_theta": schedule.get_theta()}


def test_deepspeeds_defaults() -> None:
    from slipstream.runtime.progressive_layer_drop import ProgressiveLayerDrop

    schedule = ProgressiveLayerDrop()
    assert (schedule.theta, schedule.gamma) == (0.5, 0.001)
