"""`ZenFlowCPUAdam`: DeepSpeed's CPU Adam for ZenFlow, whose step is told the ZenFlow step number.

DeepSpeed's ZenFlow optimizer calls `step(step_id)` on it (without `overlap_step`): every parameter's Adam
state takes that step number before the update, so the bias correction counts ZenFlow steps rather than the
CPU updates. With `overlap_step=True` DeepSpeed steps the parameters in its optimizer process and this
object's `step` is DeepSpeedCPUAdam's own. Slipstream's ZenFlow (zero/zenflow.py) sets the step counts on
whichever host optimizer the config builds, so it does not need this class; it is here for code that
builds it by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.ops.adam.cpu_adam import DeepSpeedCPUAdam

__all__ = ["ZenFlowCPUAdam"]


class ZenFlowCPUAdam(DeepSpeedCPUAdam):
    """DeepSpeedCPUAdam plus `overlap_step`; without it `step(step_id)` updates at step number `step_id`."""

    def __init__(self, *args: Any, overlap_step: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overlap_step = bool(overlap_step)
        if not self.overlap_step:
            self.step = self._sequential_step  # type: ignore[method-assign,assignment]

    @torch.no_grad()
    def _sequential_step(self, step_id: int, closure: Callable[[], float] | None = None) -> float | None:
        """One Adam step of every parameter with a gradient, at step number `step_id` (1-based)."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(self._init_state(param))
                state["step"].fill_(int(step_id) - 1)  # the update adds one
        return DeepSpeedCPUAdam.step(self, closure)
