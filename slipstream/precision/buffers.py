"""`data_types.buffer_dtype`: the model's floating-point buffers (BatchNorm running statistics, rotary caches
registered as buffers) cast to one dtype after ZeRO has placed the model.

Without the key the buffers stay as placement leaves them (stages 0-2 move the whole module to the parameter
dtype, stage 3 keeps the buffers' own dtype). Integer and boolean buffers (`num_batches_tracked`, masks) are
never cast. Buffers are not sharded at any stage, so the cast is the same on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def cast_buffers(model: nn.Module, dtype: str | None) -> int:
    """Cast every fp32/fp16/bf16 buffer of `model` to `dtype` ("fp32", "fp16", "bf16"; None: leave them);
    returns how many were cast."""
    if dtype is None:
        return 0
    target = _DTYPES[dtype]
    cast = 0
    for buffer in model.buffers():
        if buffer.dtype in _DTYPES.values() and buffer.dtype != target:
            buffer.data = buffer.data.to(target)  # the same buffer object: references to it stay valid
            cast += 1
    return cast
