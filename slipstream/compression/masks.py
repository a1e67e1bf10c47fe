"""Pruning masks, as DeepSpeed's compression library computes them.

Every mask keeps the ceil(dense_ratio * n) largest of n importance values (ties: sort order) and zeroes the
rest. What the importance is depends on the method:
- l1 (fixed when init_compression runs): |w| per element (sparse pruning), the L1 norm of each output row of a
  Linear weight (row pruning), of each output channel's kernel of a Conv2d weight (channel pruning);
- topk: a learned score per unit (row, head or channel), trained through the mask: in backward the mask's
  gradient passes unchanged to the scores (a straight-through estimator).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["StructuredMask", "keep_largest", "unit_norms"]


def keep_largest(importance: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """1.0 at the ceil(dense_ratio * numel) largest entries of `importance`, 0.0 elsewhere (same shape)."""
    keep = math.ceil(dense_ratio * importance.numel())
    order = importance.detach().flatten().argsort(descending=True)
    mask = torch.zeros(importance.numel(), dtype=importance.dtype, device=importance.device)
    mask[order[:keep]] = 1.0
    return mask.reshape(importance.shape)


class _TopK(torch.autograd.Function):
    """keep_largest in forward; the gradient passes straight through to the scores in backward."""

    @staticmethod
    def forward(ctx: object, scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
        return keep_largest(scores, dense_ratio)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def unit_norms(weight: torch.Tensor) -> torch.Tensor:
    """The L1 norm of each output unit of `weight` (its first dimension: Linear rows, Conv2d kernels)."""
    return weight.detach().abs().reshape(weight.shape[0], -1).sum(dim=1)


class StructuredMask(nn.Module):
    """A mask over the units (rows, heads or channels) of one layer, on from the scheduler's offset.

    l1: the mask is fixed from `norms` (one per unit) now (a buffer); topk: `scores` is a parameter (the optimizer trains it
    when built after init_compression) initialised as DeepSpeed does (kaiming-uniform, a = sqrt(5)).
    """

    def __init__(self, method: str, dense_ratio: float, norms: torch.Tensor, score_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.method, self.dense_ratio, self.enabled = method, dense_ratio, False
        self.scores: nn.Parameter | None = None
        if method == "l1":
            self.register_buffer("fixed", keep_largest(norms, dense_ratio))
        else:  # DeepSpeed's score shapes: (rows, 1), (1, heads), (channels, 1, 1, 1)
            self.scores = nn.Parameter(torch.empty(score_shape, device=norms.device))
            nn.init.kaiming_uniform_(self.scores, a=math.sqrt(5))
            self.register_buffer("fixed", None)

    def mask(self) -> torch.Tensor:
        """The current mask, one value per unit (flat)."""
        if self.scores is not None:
            return _TopK.apply(self.scores, self.dense_ratio).reshape(-1)
        fixed = self.fixed
        if not isinstance(fixed, torch.Tensor):  # l1 registers its mask when built
            raise RuntimeError(f"{self.method} pruning mask has no fixed mask and no scores")
        return fixed

    def kept(self) -> torch.Tensor:
        """The units kept, as a boolean index (what redundancy_clean slices with)."""
        return self.mask().detach() > 0
