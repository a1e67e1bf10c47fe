"""Op builders: one declarative class per native op, the `ALL_OPS` registry, and the build/load machinery.

Nothing here imports torch or compiles at import time; `setup.py` imports this package to build ops
ahead of time.
"""

from __future__ import annotations

from slipstream.ops.op_builder.all_ops import ALL_OPS, get_builder
from slipstream.ops.op_builder.async_io import AsyncIOBuilder
from slipstream.ops.op_builder.builder import Compatibility, CPUOpBuilder, LoadedOp, OpBuilder, ops_policy
from slipstream.ops.op_builder.cpu_adam import CPUAdamBuilder
from slipstream.ops.op_builder.cpu_lamb import CPULambBuilder
from slipstream.ops.op_builder.cuda_builder import CUDAOpBuilder
from slipstream.ops.op_builder.deepspeed_names import *  # noqa: F403 (DeepSpeed's other builder names)
from slipstream.ops.op_builder.deepspeed_names import BUILDERS as _DEEPSPEED_BUILDERS
from slipstream.ops.op_builder.errors import OpBuildError, OpIncompatibleError

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdamBuilder",
    "CPULambBuilder",
    "CPUOpBuilder",
    "CUDAOpBuilder",
    "Compatibility",
    "LoadedOp",
    "OpBuildError",
    "OpBuilder",
    "OpIncompatibleError",
    "get_builder",
    "ops_policy",
    *(cls.__name__ for cls in _DEEPSPEED_BUILDERS),
]
