"""Model compression (docs/compression.md): weight quantization, sparse, row and head pruning of nn.Linear
modules, channel pruning of nn.Conv2d modules; DeepSpeed's init_compression / redundancy_clean /
compression_scheduler."""

from __future__ import annotations

from slipstream.compression.compress import compression_scheduler, init_compression, redundancy_clean
from slipstream.compression.layers import CompressedConv2d, CompressedLinear

__all__ = ["CompressedConv2d", "CompressedLinear", "compression_scheduler", "init_compression", "redundancy_clean"]
