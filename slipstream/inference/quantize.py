"""int8 weight-only quantization for `init_inference(dtype=torch.int8)`.

Every `nn.Linear` becomes an `Int8Linear`: its weight stored as int8, quantized symmetrically per output row
(scale = the row's largest magnitude / 127), and dequantized to the activations' dtype inside the forward; the
bias and every other parameter stay in fp16, the dtype the rest of the model computes in (as DeepSpeed runs an
int8 model). The weights take a quarter of their fp32 bytes (plus one scale per row); the matmul itself is a
floating one. Applied after the model is placed, on one rank's whole model: tensor parallelism with int8 is
refused by the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

COMPUTE_DTYPE = torch.float16


class Int8Linear(nn.Module):
    """A linear layer with int8 weights quantized per output row (see the module doc)."""

    weight_int8: torch.Tensor
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("weight_int8", torch.round(weight / scale).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(COMPUTE_DTYPE))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(COMPUTE_DTYPE))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight_int8.to(dtype) * self.scale.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_linears(model: nn.Module) -> nn.Module:
    """`model` with every `nn.Linear` replaced by an `Int8Linear` (in place; a model that is itself a linear layer
    is returned replaced). A weight shared with another module (a tied LM head) is quantized for the linear layer
    only: the other module keeps it in fp16."""
    if isinstance(model, nn.Linear):
        return Int8Linear(model)
    named = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in named:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Int8Linear(linear))
    return model
