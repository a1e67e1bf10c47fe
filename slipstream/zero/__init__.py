"""ZeRO: partition math, flat buffers, stages 0-3, loss scaling; DeepSpeed's `deepspeed.zero` surface.

`slipstream.zero.Init`, `GatheredParameters`, `ZeroParamStatus`, `set_z3_leaf_modules`,
`unwrap_model_for_generation`, `register_external_parameter` and the weight hand-off to a generator process
(`broadcast_full_weights`, `receive_full_weights`) load on first access (importing this
package stays cheap).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Init": "slipstream.zero.init",
    "GatheredParameters": "slipstream.zero.gathered",
    "unwrap_model_for_generation": "slipstream.zero.gathered",
    "register_external_parameter": "slipstream.zero.gathered",
    "ZeroParamStatus": "slipstream.zero.stage3.sharded_param",
    "ShardedParameterError": "slipstream.zero.stage3.sharded_param",
    "set_z3_leaf_modules": "slipstream.zero.stage3.leaves",
    "broadcast_full_weights": "slipstream.zero.weight_broadcast",
    "receive_full_weights": "slipstream.zero.weight_broadcast",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slipstream.zero' has no attribute {name!r}")
