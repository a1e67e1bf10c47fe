"""Adam optimizers backed by the native ops: `DeepSpeedCPUAdam` (CPU / ZeRO-Offload) and `FusedAdam`
(the device Adam/AdamW a config's "Adam" builds), and ZenFlow's selective AdamW (`ZenFlowSelectiveAdamW`,
`ZenFlowSelectiveAdamW_stage3`)."""

from __future__ import annotations

from slipstream.ops.adam.cpu_adam import DeepSpeedCPUAdam
from slipstream.ops.adam.fused_adam import FusedAdam
from slipstream.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]
