"""`deepspeed.runtime.progressive_layer_drop.ProgressiveLayerDrop`: DeepSpeed's constructor (theta, gamma as
numbers) over Slipstream's keep-probability schedule (data/layer_drop.py), which takes the config's plan."""

from __future__ import annotations

from slipstream.config.data_plans import LayerDropPlan
from slipstream.data.layer_drop import ProgressiveLayerDrop as _ProgressiveLayerDrop

__all__ = ["ProgressiveLayerDrop"]


class ProgressiveLayerDrop(_ProgressiveLayerDrop):
    """theta(t) = (1 - theta) * exp(-gamma * t) + theta after `update_state(t)`; 1.0 before the first update."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        super().__init__(LayerDropPlan(theta=theta, gamma=gamma))
