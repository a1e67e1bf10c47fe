"""Adam optimizers backed by the native ops: `DeepSpeedCPUAdam` (CPU / ZeRO-Offload) and `FusedAdam`
(the device Adam/AdamW a config's "Adam" builds)."""

from __future__ import annotations

from slipstream.ops.adam.cpu_adam import DeepSpeedCPUAdam
from slipstream.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
