"""DeepSpeed's `deepspeed.runtime.zero.linear`: a linear layer whose backward recomputes nothing and keeps only
the input, the weight and the bias (`LinearFunctionForZeroStage3`, `zero3_linear_wrap`,
`LinearModuleForZeroStage3`).

DeepSpeed needs it because its ZeRO-3 weights may be partitioned again before the backward. Slipstream's
stage 3 gathers a unit's parameters for its backward itself (slipstream/zero/stage3/), so here it is an
ordinary linear with the same gradients as `torch.nn.functional.linear`, for code that calls it by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap"]


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """y = x W^T + b, saving (x, W, b) for the backward."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = flat_grad.t().matmul(input.reshape(-1, input.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = flat_grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(nn.Module):
    """`nn.Linear`'s parameters and initialisation, computed through LinearFunctionForZeroStage3."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
