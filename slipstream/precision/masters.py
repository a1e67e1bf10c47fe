"""Low-precision master weights and optimizer states: the optimizer's side.

With `bf16.bf16_master_weights_and_grads` (or `fp16.fp16_master_weights_and_grads`) the ZeRO groups take the
low-precision parameters' shards as their masters (zero/flat_group.py, zero/stage3/group.py: the master dtype
is the parameter dtype, so the master pieces are views of the parameters, or their host copies with offload)
and the optimizer steps them directly. Its moments then follow the plan's `optimizer_state_dtype`:
- bf16 (`bf16_optimizer_states`): torch's and FusedAdam's states take the parameter dtype by themselves; the
  CPU Adam op is told to keep them in bf16 (`fp32_optimizer_states=False`, as DeepSpeed overrides it);
- fp32: only an optimizer that keeps fp32 moments of low-precision parameters can do it (the CPU Adam op,
  which is why DeepSpeed asks for CPU offload here); any other is refused before the first step.
The update is rounded to nearest when it is stored in the low-precision masters (torch's own rounding).
"""

from __future__ import annotations

import torch

from slipstream.config.plan import PrecisionPlan
from slipstream.utils.logging import warn_once


def apply_state_dtype(optimizer: torch.optim.Optimizer, precision: PrecisionPlan) -> None:
    """Make `optimizer` keep its moments in the plan's state dtype, or refuse it naming the keys."""
    if precision.master_dtype == "fp32":
        return
    keeps_fp32 = getattr(optimizer, "fp32_optimizer_states", None)
    if precision.optimizer_state_dtype != "fp32":
        if keeps_fp32:
            warn_once(
                "bf16-optimizer-states-cpu-adam",
                "slipstream: bf16.bf16_optimizer_states is on; the CPU Adam's fp32_optimizer_states is set to "
                "False so its moments are kept in bf16",
            )
            optimizer.fp32_optimizer_states = False  # type: ignore[attr-defined]
        return
    if keeps_fp32 is not True:
        key = f"{precision.master_dtype}.{precision.master_dtype}_master_weights_and_grads"
        raise ValueError(
            f"{key}: the optimizer must keep fp32 moments of the {precision.master_dtype} masters, which only "
            f"the CPU Adam op does (DeepSpeedCPUAdam with fp32_optimizer_states=True, built for an 'Adam' or "
            f"'AdamW' optimizer section with CPU offload); got {type(optimizer).__name__}. Use that "
            f"optimizer{', or set bf16.bf16_optimizer_states true' if precision.master_dtype == 'bf16' else ''}"
        )
