"""DeepSpeed's op-builder names that Slipstream has no native op for, and `compatible_ops` (DeepSpeed's
`deepspeed.ops.__compatible_ops__`: op name -> whether it can run here).

`FusedAdamBuilder` is compatible: DeepSpeed's fused Adam is `slipstream.ops.adam.FusedAdam`, torch's fused
(or foreach) Adam kernel on every device, so there is nothing to compile and `load()` returns the Python
module that has it; so is `SparseAttnBuilder` (block-sparse attention in PyTorch, ops/sparse_attention/).
`UtilsBuilder().load()` gives `flatten` / `unflatten`. Every other name is a builder that says, from
`is_compatible()` (False) and `load()` (OpIncompatibleError), why it cannot run here.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any, ClassVar

from slipstream.ops.op_builder.builder import Compatibility
from slipstream.ops.op_builder.errors import OpIncompatibleError

_INFERENCE = "DeepSpeed-Inference kernels are not part of Slipstream (it trains; use torch or vLLM for inference)"
_TRAINING_KERNEL = "no native kernel in Slipstream; the config's optimizer of that name builds the PyTorch version"


class DeepSpeedNamedBuilder:
    """A DeepSpeed builder name: `NAME`, `BUILD_VAR`, `is_compatible()`, `load()`, `absolute_name()`."""

    NAME: ClassVar[str] = ""
    REASON: ClassVar[str] = ""
    MODULE: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return self.NAME

    @property
    def BUILD_VAR(self) -> str:
        return f"DS_BUILD_{self.NAME.upper()}"

    def absolute_name(self) -> str:
        return self.MODULE or f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> Compatibility:
        return Compatibility(not self.REASON, self.REASON)

    def load(self, verbose: bool = True) -> Any:
        if self.REASON:
            raise OpIncompatibleError(self.NAME, self.REASON)
        return importlib.import_module(self.MODULE)

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)


class FusedAdamBuilder(DeepSpeedNamedBuilder):
    NAME = "fused_adam"
    MODULE = "slipstream.ops.adam"


def _flatten(tensors: Any) -> Any:
    import torch

    return torch.cat([t.contiguous().view(-1) for t in tensors])


def _unflatten(flat: Any, tensors: Any) -> list[Any]:
    out, offset = [], 0
    for t in tensors:
        out.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return out


class UtilsBuilder(DeepSpeedNamedBuilder):
    NAME = "utils"

    def load(self, verbose: bool = True) -> Any:
        return SimpleNamespace(flatten=_flatten, unflatten=_unflatten)


class SparseAttnBuilder(DeepSpeedNamedBuilder):
    """Block-sparse attention is pure PyTorch (ops/sparse_attention/): nothing to compile."""

    NAME = "sparse_attn"
    MODULE = "slipstream.ops.sparse_attention"


def _incompatible(name: str, op: str, reason: str) -> type[DeepSpeedNamedBuilder]:
    return type(name, (DeepSpeedNamedBuilder,), {"NAME": op, "REASON": reason, "__doc__": f"{op}: {reason}"})


CPUAdagradBuilder = _incompatible("CPUAdagradBuilder", "cpu_adagrad", _TRAINING_KERNEL + " (torch.optim.Adagrad)")
CPULionBuilder = _incompatible("CPULionBuilder", "cpu_lion", _TRAINING_KERNEL + " (Lion)")
FusedLambBuilder = _incompatible("FusedLambBuilder", "fused_lamb", _TRAINING_KERNEL + " (Lamb)")
FusedLionBuilder = _incompatible("FusedLionBuilder", "fused_lion", _TRAINING_KERNEL + " (Lion)")
TransformerBuilder = _incompatible(
    "TransformerBuilder", "transformer", "DeepSpeed's fused transformer layer is not part of Slipstream"
)
StochasticTransformerBuilder = _incompatible(
    "StochasticTransformerBuilder",
    "stochastic_transformer",
    "DeepSpeed's fused transformer layer is not part of Slipstream",
)
InferenceBuilder = _incompatible("InferenceBuilder", "transformer_inference", _INFERENCE)
InferenceCoreBuilder = _incompatible("InferenceCoreBuilder", "inference_core_ops", _INFERENCE)
InferenceCutlassBuilder = _incompatible("InferenceCutlassBuilder", "cutlass_ops", _INFERENCE)
RaggedOpsBuilder = _incompatible("RaggedOpsBuilder", "ragged_device_ops", _INFERENCE)
RaggedUtilsBuilder = _incompatible("RaggedUtilsBuilder", "ragged_ops", _INFERENCE)
SpatialInferenceBuilder = _incompatible("SpatialInferenceBuilder", "spatial_inference", _INFERENCE)
EvoformerAttnBuilder = _incompatible(
    "EvoformerAttnBuilder", "evoformer_attn", "Evoformer attention is not part of Slipstream"
)
FPQuantizerBuilder = _incompatible(
    "FPQuantizerBuilder", "fp_quantizer", "ZeRO++ quantized communication is not implemented"
)
QuantizerBuilder = _incompatible("QuantizerBuilder", "quantizer", "ZeRO++ quantized communication is not implemented")
RandomLTDBuilder = _incompatible("RandomLTDBuilder", "random_ltd", "random layer-token drop is not implemented")
GDSBuilder = _incompatible("GDSBuilder", "gds", "GPUDirect Storage is not implemented; NVMe offload uses async_io")
DeepCompileBuilder = _incompatible(
    "DeepCompileBuilder", "dc", "DeepCompile is not implemented; use torch.compile on the model"
)
PackbitsBuilder = _incompatible("PackbitsBuilder", "packbits", "1-bit optimizers are not implemented")
ShareMemCommBuilder = _incompatible(
    "ShareMemCommBuilder", "deepspeed_shm_comm", "Slipstream's CPU collectives are gloo's"
)
CCLCommBuilder = _incompatible(
    "CCLCommBuilder", "deepspeed_ccl_comm", "oneCCL is not supported; CPU collectives are gloo's"
)

BUILDERS: tuple[type[DeepSpeedNamedBuilder], ...] = (
    FusedAdamBuilder,
    UtilsBuilder,
    CPUAdagradBuilder,
    CPULionBuilder,
    FusedLambBuilder,
    FusedLionBuilder,
    TransformerBuilder,
    StochasticTransformerBuilder,
    InferenceBuilder,
    InferenceCoreBuilder,
    InferenceCutlassBuilder,
    RaggedOpsBuilder,
    RaggedUtilsBuilder,
    SpatialInferenceBuilder,
    SparseAttnBuilder,
    EvoformerAttnBuilder,
    FPQuantizerBuilder,
    QuantizerBuilder,
    RandomLTDBuilder,
    GDSBuilder,
    DeepCompileBuilder,
    PackbitsBuilder,
    ShareMemCommBuilder,
    CCLCommBuilder,
)


def __getattr__(name: str) -> Any:
    if name == "compatible_ops":
        from slipstream.ops.op_builder.all_ops import ALL_OPS

        found = {op: bool(builder.is_compatible()) for op, builder in ALL_OPS.items()}
        found.update({cls.NAME: bool(cls().is_compatible()) for cls in BUILDERS})
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
