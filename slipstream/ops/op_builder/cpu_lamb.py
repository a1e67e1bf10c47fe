"""The `cpu_lamb` op: LAMB's moments, update and per-part norms in one SIMD + OpenMP pass, then the scaled
update (slipstream/optim/lamb.py steps fp32 CPU tensors with it; DS_BUILD_CPU_LAMB builds it ahead of time)."""

from __future__ import annotations

from slipstream.ops.op_builder.builder import CPUOpBuilder


class CPULambBuilder(CPUOpBuilder):
    NAME = "cpu_lamb"
    SOURCES = ("lamb/cpu_lamb.cpp",)
