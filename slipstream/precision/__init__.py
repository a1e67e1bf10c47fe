"""Precision beyond the parameter dtype: the forward under torch.autocast (autocast.py) and low-precision
master weights and optimizer states (masters.py)."""

from slipstream.precision.autocast import AutocastRegion, NoAutocast, forward_region
from slipstream.precision.masters import apply_state_dtype

__all__ = ["AutocastRegion", "NoAutocast", "apply_state_dtype", "forward_region"]
