"""Model parallelism on one device mesh: tensor parallelism (AutoTP for training, on DTensor) and the groups
of data x sequence x tensor parallel jobs. Ulysses sequence parallelism itself is `slipstream.sequence`."""

from __future__ import annotations

from slipstream.parallel.mesh import Topology, build_topology
from slipstream.parallel.tensor import (
    TensorParallelError,
    TensorParallelModel,
    apply_tensor_parallel,
    plan_tensor_parallel,
    whole_head_widths,
)

__all__ = [
    "TensorParallelError",
    "TensorParallelModel",
    "Topology",
    "apply_tensor_parallel",
    "build_topology",
    "plan_tensor_parallel",
    "whole_head_widths",
]
