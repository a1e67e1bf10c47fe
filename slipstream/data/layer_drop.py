"""Progressive layer drop: the keep probability a model with droppable layers receives in its forward.

theta(t) = (1 - theta) * exp(-gamma * t) + theta, starting from 1.0 (keep every layer). As in DeepSpeed the
value is updated at each optimizer-step boundary from the global step before that step counts, so the forward
of global step g (g >= 1) sees theta(g - 1) and the first forward sees 1.0. Here it is a function of the global
step alone, so a run resumed from a checkpoint continues the same curve. The exponential is numpy's where numpy is
installed, as in DeepSpeed, so the values are the same bits as DeepSpeed's (math.exp differs from it in the last
bit for some steps).
"""

from __future__ import annotations

import math

from slipstream.config.data_plans import LayerDropPlan

__all__ = ["ProgressiveLayerDrop"]


def _exp(x: float) -> float:
    """numpy's exp when numpy is installed (DeepSpeed's), else math's."""
    try:
        import numpy
    except ImportError:
        return math.exp(x)
    return float(numpy.exp(x))


class ProgressiveLayerDrop:
    """The keep probability per global step for one `LayerDropPlan`."""

    def __init__(self, plan: LayerDropPlan) -> None:
        self.theta = plan.theta
        self.gamma = plan.gamma
        self.current_theta = 1.0

    def update_state(self, global_step: int) -> None:
        """The keep probability after the optimizer step taken at `global_step`."""
        self.current_theta = (1.0 - self.theta) * _exp(-self.gamma * global_step) + self.theta

    def theta_for_step(self, global_steps: int) -> float:
        """The keep probability the forward of `global_steps` sees (1.0 before the first optimizer step)."""
        if global_steps > 0:
            self.update_state(global_steps - 1)
        return self.current_theta

    def get_theta(self) -> float:
        return self.current_theta

    def get_state(self) -> dict[str, bool | float]:
        """The forward's keyword arguments."""
        return {"progressive_layer_drop": True, "pld_theta": self.current_theta}
