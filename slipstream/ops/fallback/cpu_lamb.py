"""Pure-PyTorch `cpu_lamb`: the native module's functions (slipstream/ops/csrc/lamb/cpu_lamb.cpp) as torch ops.

Same interface and results as the native op (the two are tested against each other); used where no compiler
is available, with SLIPSTREAM_OPS=fallback, and for what the native op does not take (tensors off the CPU,
parameters in a low precision: the math is in the updates' dtype, fp32 at least). See [Note: cpu_lamb
passes] in the C++ source for what each function computes.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["lamb_apply", "lamb_moments", "simd_level"]


def simd_level() -> str:
    """Always 'fallback' (the native module reports its SIMD level)."""
    return "fallback"


def lamb_moments(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    updates: list[Tensor],
    segments: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    eps_inside_sqrt: bool,
) -> Tensor:
    """Moments m, v and the update u = m / (sqrt(v) + eps) + weight_decay p (eps_inside_sqrt: m / sqrt(v + eps))
    into `updates`; returns float64 [S, 2]: per segment (tensor, start, end), the sums of p^2 and u^2."""
    for p, g, m, v, u in zip(params, grads, exp_avgs, exp_avg_sqs, updates, strict=True):
        g = g.to(u.dtype)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if eps_inside_sqrt:
            torch.add(v, eps, out=u).sqrt_()
        else:
            torch.sqrt(v, out=u).add_(eps)
        torch.div(m, u, out=u)
        if weight_decay:
            u.add_(p.to(u.dtype), alpha=weight_decay)
    rows = segments.tolist()
    if not rows:
        return torch.zeros(0, 2, dtype=torch.float64, device=segments.device)
    weights = [params[i].reshape(-1)[lo:hi] for i, lo, hi in rows]
    steps = [updates[i].reshape(-1)[lo:hi] for i, lo, hi in rows]
    norms = [torch.stack(torch._foreach_norm(ts, 2, dtype=_norm_dtype(ts))) for ts in (weights, steps)]
    return torch.stack(norms, dim=1).double().square()


def _norm_dtype(tensors: list[Tensor]) -> torch.dtype:
    """Norms accumulate in fp32 at least, and in fp64 for fp64 tensors (a norm may not narrow its input)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def lamb_apply(params: list[Tensor], updates: list[Tensor], segments: Tensor, scales: Tensor) -> None:
    """p -= scales[k] * u over each segment k (tensor, start, end), computed in the update's dtype."""
    for (i, lo, hi), scale in zip(segments.tolist(), scales.tolist(), strict=True):
        target, update = params[i].view(-1)[lo:hi], updates[i].view(-1)[lo:hi]
        work = target if target.dtype == update.dtype else target.to(update.dtype)
        work.add_(update, alpha=-scale)
        if work is not target:
            target.copy_(work)
