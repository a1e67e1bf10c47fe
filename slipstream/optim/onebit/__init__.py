"""The 1-bit optimizers: 1-bit Adam (adam.py), 0/1 Adam (zoadam.py) and 1-bit LAMB (lamb.py), over comm/compressed/'s all-reduce.

They run at ZeRO stage 0 and communicate themselves once their warm-up is over: the ZeRO-0 optimizer asks
`takes_over_reduction(group)` before each step (see [Note: optimizers that communicate themselves] in
zero/stage0.py) and, when the answer is True, hands them this rank's own gradients.
"""

from __future__ import annotations

from slipstream.optim.onebit.adam import OneBitAdam
from slipstream.optim.onebit.lamb import OneBitLamb
from slipstream.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
