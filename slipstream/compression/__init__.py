"""Model compression (docs/compression.md): weight quantization and l1 sparse pruning of nn.Linear modules,
DeepSpeed's init_compression / redundancy_clean / compression_scheduler."""

from __future__ import annotations

from slipstream.compression.compress import compression_scheduler, init_compression, redundancy_clean
from slipstream.compression.layers import CompressedLinear

__all__ = ["CompressedLinear", "compression_scheduler", "init_compression", "redundancy_clean"]
