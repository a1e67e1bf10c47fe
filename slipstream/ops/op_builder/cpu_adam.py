"""The `cpu_adam` op: SIMD + OpenMP Adam/AdamW for CPU and ZeRO-Offload (DeepSpeed's DS_BUILD_CPU_ADAM)."""

from __future__ import annotations

from types import ModuleType

from slipstream.ops.op_builder.builder import CPUOpBuilder


class CPUAdamBuilder(CPUOpBuilder):
    NAME = "cpu_adam"
    SOURCES = ("adam/cpu_adam.cpp",)

    def load(self, verbose: bool = False) -> ModuleType:
        """The op module, with DeepSpeed's functional interface added (`create_adam`, id-based `adam_update`,
        the ZenFlow optimizer-process functions: slipstream/ops/adam/ds_op_api.py)."""
        from slipstream.ops.adam.ds_op_api import install

        return install(super().load(verbose=verbose))
