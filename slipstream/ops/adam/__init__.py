"""Adam optimizers backed by the native ops: `DeepSpeedCPUAdam` (CPU / ZeRO-Offload)."""

from __future__ import annotations

from slipstream.ops.adam.cpu_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
