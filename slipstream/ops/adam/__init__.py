"""Adam optimizers backed by the native ops: `DeepSpeedCPUAdam` (CPU / ZeRO-Offload) and `FusedAdam`
(the device Adam/AdamW a config's "Adam" builds), ZenFlow's selective AdamW (`ZenFlowSelectiveAdamW`,
`ZenFlowSelectiveAdamW_stage3`) and `ZenFlowCPUAdam`."""

from __future__ import annotations

from slipstream.ops.adam.cpu_adam import DeepSpeedCPUAdam
from slipstream.ops.adam.fused_adam import FusedAdam
from slipstream.ops.adam.zenflow_cpu_adam import ZenFlowCPUAdam
from slipstream.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]
