"""LAMB (https://arxiv.org/abs/1904.00962) as DeepSpeed's FusedLamb kernel computes it, with its arguments and
defaults, at every ZeRO stage.

For each parameter w with gradient g, at step t:
    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
    u = m / (sqrt(v) + eps) + weight_decay w             (eps_inside_sqrt: m / sqrt(v + eps))
    ratio = clamp(||w|| / ||u||, min_coeff, max_coeff)    (1 when either norm is 0)
    w -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * ratio * u   (bias_correction; else lr * ratio * u)
The moments in u are not bias-corrected: the correction is a factor of the step size, outside the trust ratio,
as in the kernel. The norms are of the whole parameter. Under ZeRO a parameter is cut across ranks and
pieces, so a step is:
    Phase 1: per param group, one `cpu_lamb.lamb_moments` call: moments and u for every piece this rank owns,
             u kept in a reused scratch buffer, with the sums of squares of w and of u over each part of a
             parameter in the same sweep ([Note: cpu_lamb passes] in ops/csrc/lamb/cpu_lamb.cpp);
    Phase 2: the parts' sums added per parameter, then ONE all-reduce of the (parameters x 2) vector over the
             data-parallel group ([Note: whole-tensor map]);
    Phase 3: per param group, one `cpu_lamb.lamb_apply` call: each part moved by its step size times its
             parameter's ratio.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import Tensor

from slipstream.ops.fallback import cpu_lamb as fallback_lamb
from slipstream.optim.arguments import AdamFamily, bind, takes
from slipstream.optim.common import WholeTensorOptimizer, closure_loss, math_dtype
from slipstream.zero.whole_tensors import WholeTensorMap

__all__ = ["FusedLamb", "LambArguments", "LambCoeffs", "trust_ratios"]

Params = Iterable[Tensor] | Iterable[dict[str, Any]]


def trust_ratios(norms: Tensor, min_coeff: Tensor, max_coeff: Tensor) -> Tensor:
    """||w|| / ||u|| clamped to [min_coeff, max_coeff] per row of `norms` ([||w||, ||u||]); 1 where either is 0."""
    w_norm, u_norm = norms[:, 0], norms[:, 1]
    ratio = (w_norm / u_norm.clamp_min(1e-300)).clamp(min=min_coeff, max=max_coeff)
    return torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LambArguments(AdamFamily):
    ORDER: ClassVar[tuple[str, ...]] = (
        "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm", "max_coeff",
        "min_coeff", "amsgrad",
    )  # fmt: skip
    GROUP_KEYS: ClassVar[tuple[str, ...]] = (
        "lr", "bias_correction", "betas", "eps", "weight_decay", "eps_inside_sqrt", "max_coeff", "min_coeff"
    )  # fmt: skip
    max_coeff: float = 10.0
    """The trust ratio's upper clamp."""
    min_coeff: float = 0.01
    """The trust ratio's lower clamp."""

    def problems(self) -> list[str]:
        out = super().problems()
        if self.max_grad_norm:
            out.append(
                f"max_grad_norm={self.max_grad_norm} is not supported; use the top-level 'gradient_clipping' "
                "config key instead"
            )
        if not 0.0 < self.min_coeff <= self.max_coeff:
            out.append(f"needs 0 < min_coeff <= max_coeff; got min_coeff={self.min_coeff}, max_coeff={self.max_coeff}")
        return out


@dataclasses.dataclass(frozen=True)
class _Batch:
    """One param group's pieces stepped in one op call: their updates (scratch buffers), the parts of them that
    belong to parameters (`segments`: int64 rows (piece number, start, end); `rows`: each one's parameter), this
    rank's sums of w^2 and u^2 per segment, and the op (native or fallback) that computed them."""

    group: dict[str, Any]
    pieces: list[Tensor]
    updates: list[Tensor]
    segments: Tensor
    rows: list[int]
    sums: Tensor
    op: ModuleType


class LambCoeffs:
    """DeepSpeed's `get_lamb_coeffs()`, shared by both LAMBs: `lamb_coeffs` is each parameter's trust ratio in
    the last step, by parameter number."""

    lamb_coeffs: list[float]

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)


class FusedLamb(LambCoeffs, WholeTensorOptimizer):
    """LAMB with DeepSpeed FusedLamb's arguments (LambArguments); the trust ratio uses each parameter's
    whole-tensor norms. The passes over memory are the `cpu_lamb` op's ([Note: cpu_lamb passes]); fp32 CPU
    tensors go to its native build when there is one, the rest to its PyTorch fallback."""

    @takes(LambArguments)
    def __init__(self, params: Params, *args: object, **kwargs: object) -> None:
        super().__init__(params, bind(LambArguments, args, kwargs).group_defaults())
        self.lamb_coeffs = []
        self._op: ModuleType | None = None
        """The loaded `cpu_lamb` op (native or fallback), on first use; tests may pin one."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        whole = self.whole_tensors()
        found = (self._moments(group, whole) for group in self.param_groups)  # phase 1
        batches = [b for b in found if b is not None]
        rows = [row for b in batches for row in b.rows]
        local = torch.cat([b.sums for b in batches]) if batches else torch.zeros(0, 2, dtype=torch.float64)
        norms = whole.total_sums(rows, local).sqrt()  # phase 2: ONE all-reduce
        limits = torch.tensor(
            [[self.param_groups[g]["min_coeff"], self.param_groups[g]["max_coeff"]] for g in whole.group_of],
            dtype=torch.float64,
            device=norms.device,
        ).reshape(-1, 2)
        ratios = trust_ratios(norms, limits[:, 0], limits[:, 1]).tolist()
        self.lamb_coeffs = ratios
        for b in batches:  # phase 3
            steps = [b.group["lr"] * _bias_correction(b.group, int(self.state[p]["step"])) for p in b.pieces]
            pieces = b.segments[:, 0].tolist()
            scales = [steps[piece] * ratios[row] for piece, row in zip(pieces, b.rows, strict=True)]
            b.op.lamb_apply(b.pieces, b.updates, b.segments, torch.tensor(scales, dtype=torch.float64))
        return loss

    def _moments(self, group: dict[str, Any], whole: WholeTensorMap) -> _Batch | None:
        """Phase 1 for one param group: moments, updates u (weight decay included) and their parts' sums."""
        pieces = [p for p in group["params"] if p.grad is not None]
        if not pieces:
            return None
        if any(p.grad.is_sparse for p in pieces):
            raise RuntimeError("Lamb does not support sparse gradients")
        states = [self.advance_moments(p, math_dtype(p)) for p in pieces]
        segments, rows = [], []
        for number, p in enumerate(pieces):
            for part in whole.parts(p):
                segments.append((number, part.offset, part.offset + part.numel))
                rows.append(part.tensor)
        updates = [self.scratch(p) for p in pieces]
        grads = [p.grad for p in pieces]
        op = self._op_for([*pieces, *grads])
        table = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
        beta1, beta2 = group["betas"]
        sums = op.lamb_moments(
            pieces,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            updates,
            table,
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["eps_inside_sqrt"],
        )
        return _Batch(group, pieces, updates, table, rows, sums, op)

    def _op_for(self, tensors: list[Tensor]) -> ModuleType:
        """The native op for contiguous fp32 CPU tensors when it built, else the PyTorch fallback."""
        if self._op is None:
            from slipstream.ops.op_builder import CPULambBuilder

            self._op = CPULambBuilder().load()
        native = all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        return self._op if native else fallback_lamb


def _bias_correction(group: dict[str, Any], step: int) -> float:
    """The kernel's step-size factor sqrt(1 - beta2^t) / (1 - beta1^t) (1 without bias_correction)."""
    if not group["bias_correction"]:
        return 1.0
    beta1, beta2 = group["betas"]
    return math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
