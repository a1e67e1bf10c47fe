"""The `compression_training` section (DeepSpeed's compression library). Each method is kept as the user wrote
it: slipstream/compression/plan.py reads the methods it builds into its own plans (and reports their sub-options
it does not build, by name, when init_compression reads them); the methods it does not build are reported here."""

from __future__ import annotations

from typing import Any

from slipstream.config.schema.base import OpenSection

__all__ = ["CompressionTrainingConfig"]

Method = dict[str, Any] | None
_PLAN = "compression_training"


class CompressionTrainingConfig(OpenSection):
    """`compression_training`: one sub-section per method, each with `shared_parameters` and `different_groups`."""

    IMPLEMENTED = {
        "weight_quantization": _PLAN,
        "activation_quantization": _PLAN,
        "sparse_pruning": _PLAN,
        "row_pruning": _PLAN,
        "head_pruning": _PLAN,
        "channel_pruning": _PLAN,
        "layer_reduction": _PLAN,
    }

    weight_quantization: Method = None
    """Fake-quantized Linear weights, bits stepping down on a schedule."""
    activation_quantization: Method = None
    """Fake-quantized inputs of Linear and Conv2d layers (dynamic or static ranges) from a schedule offset."""
    sparse_pruning: Method = None
    """Unstructured masks of Linear weights: l1 (magnitudes) or topk (learned scores); snip_momentum reported."""
    row_pruning: Method = None
    """Output rows of Linear layers masked, then removed by redundancy_clean."""
    head_pruning: Method = None
    """Attention heads masked at the output projection's input, then removed by redundancy_clean."""
    channel_pruning: Method = None
    """Output channels of Conv2d layers masked, then removed by redundancy_clean."""
    layer_reduction: Method = None
    """A student with fewer layers initialised from a teacher's chosen layers (init_compression's teacher_model)."""

    def methods(self) -> dict[str, Any]:
        """The methods the user set, as JSON data (what slipstream/compression/plan.py reads)."""
        return self.model_dump(mode="json", exclude_none=True)
