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
    Phase 1: moments and u for every piece this rank owns (elementwise), u kept in a reused scratch buffer;
    Phase 2: per parameter, the sums of squares of w and of u over its parts here, then ONE all-reduce of the
             (parameters x 2) vector over the data-parallel group ([Note: whole-tensor map]);
    Phase 3: each parameter's ratio applied to its parts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from slipstream.optim.arguments import AdamFamily, bind, takes
from slipstream.optim.common import WholeTensorOptimizer, apply_update, closure_loss, math_dtype

__all__ = ["FusedLamb", "LambArguments", "trust_ratios"]

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


class FusedLamb(WholeTensorOptimizer):
    """LAMB with DeepSpeed FusedLamb's arguments (LambArguments); the trust ratio uses each parameter's
    whole-tensor norms."""

    @takes(LambArguments)
    def __init__(self, params: Params, *args: object, **kwargs: object) -> None:
        super().__init__(params, bind(LambArguments, args, kwargs).group_defaults())
        self.lamb_coeffs: list[float] = []
        """Each parameter's trust ratio in the last step, by parameter number (DeepSpeed's `get_lamb_coeffs`)."""

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        whole = self.whole_tensors()
        stepped: list[tuple[dict[str, Any], Tensor, Tensor]] = []
        for group in self.param_groups:  # phase 1
            for p in group["params"]:
                update = self._update(group, p)
                if update is not None:
                    stepped.append((group, p, update))
        norms = whole.sum_squares((p, [p, u]) for _, p, u in stepped).sqrt()  # phase 2
        limits = torch.tensor(
            [[self.param_groups[g]["min_coeff"], self.param_groups[g]["max_coeff"]] for g in whole.group_of],
            dtype=torch.float64,
            device=norms.device,
        ).reshape(-1, 2)
        ratios = trust_ratios(norms, limits[:, 0], limits[:, 1]).tolist()
        self.lamb_coeffs = ratios
        for group, p, u in stepped:  # phase 3
            flat_p, flat_u = p.view(-1), u.view(-1)  # a ZeRO piece is flat already; a plain parameter is not
            step_size = group["lr"] * _bias_correction(group, int(self.state[p]["step"]))
            for part in whole.parts(p):
                end = part.offset + part.numel
                apply_update(flat_p[part.offset : end], flat_u[part.offset : end], lr=step_size * ratios[part.tensor])
        return loss

    def _update(self, group: dict[str, Any], p: Tensor) -> Tensor | None:
        """Phase 1 for one tensor: its moments, and u (weight decay included) in its scratch buffer."""
        if p.grad is None:
            return None
        if p.grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        dtype = math_dtype(p)
        update = self.adam_direction(  # moments not bias-corrected: see _bias_correction
            p,
            p.grad.to(dtype),
            betas=group["betas"],
            eps=group["eps"],
            bias_correction=False,
            eps_inside_sqrt=group["eps_inside_sqrt"],
        )
        if group["weight_decay"]:
            update.add_(p.to(dtype), alpha=group["weight_decay"])
        return update


def _bias_correction(group: dict[str, Any], step: int) -> float:
    """The kernel's step-size factor sqrt(1 - beta2^t) / (1 - beta1^t) (1 without bias_correction)."""
    if not group["bias_correction"]:
        return 1.0
    beta1, beta2 = group["betas"]
    return math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
