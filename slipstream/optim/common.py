"""What the optimizers here share: the math dtype, closures, and how each asks ZeRO for whole tensors.

An optimizer that needs a parameter whole (LAMB's trust ratio, Muon's orthogonalisation) sets
`wants_whole_tensors`; the ZeRO optimizer that wraps it then calls `attach_whole_tensors` with the map of its
pieces ([Note: whole-tensor map] in zero/whole_tensors.py). Without ZeRO the map is built from the optimizer's
own parameters, each one whole. `runs_on_host` says the class runs wherever its tensors live, so
offload_optimizer may step it on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from slipstream.zero.whole_tensors import WholeTensorMap

__all__ = ["WholeTensorOptimizer", "apply_update", "closure_loss", "grad_of", "math_dtype"]


def math_dtype(p: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision params (states and math), the param's own dtype when wider."""
    return torch.promote_types(p.dtype, torch.float32)


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """`p`'s gradient in its math dtype (zeros when it has none, as DeepSpeed's Muon does)."""
    dtype = math_dtype(p)
    return p.grad.to(dtype) if p.grad is not None else torch.zeros_like(p, dtype=dtype)


def apply_update(target: torch.Tensor, update: torch.Tensor, *, lr: float, decay: float = 0.0) -> None:
    """target = target (1 - lr decay) - lr update, computed in the update's dtype."""
    work = target if target.dtype == update.dtype else target.to(update.dtype)
    if decay:
        work.mul_(1.0 - lr * decay)
    work.add_(update, alpha=-lr)
    if work is not target:
        target.copy_(work)


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """`closure()` with autograd on (the step itself runs under no_grad), or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class WholeTensorOptimizer(torch.optim.Optimizer):
    """A torch optimizer that steps pieces of parameters through a whole-tensor map."""

    wants_whole_tensors = True
    runs_on_host = True
    _whole: WholeTensorMap | None = None
    _scratch: dict[int, torch.Tensor]

    def attach_whole_tensors(self, whole: WholeTensorMap) -> None:
        """Called by the ZeRO optimizer once its pieces replaced this optimizer's parameters."""
        self._whole = whole
        self._scratch = {}

    def whole_tensors(self) -> WholeTensorMap:
        """The attached map, or (no ZeRO) the map of this optimizer's own parameters."""
        return self._whole if self._whole is not None else WholeTensorMap.of_params(self.param_groups)

    def scratch(self, p: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like `p` in its math dtype, allocated on first use and reused every step."""
        if not hasattr(self, "_scratch"):
            self._scratch = {}
        found = self._scratch.get(id(p))
        if found is None or found.shape != p.shape:
            found = self._scratch[id(p)] = torch.empty_like(p, dtype=math_dtype(p))
        return found

    def advance_moments(self, p: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
        """`p`'s state with its step count advanced by one: `step`, `exp_avg`, `exp_avg_sq` (zeros in `dtype`, made
        on first use)."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["step"] += 1
        return state

    def adam_direction(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        *,
        betas: tuple[float, float],
        eps: float,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
    ) -> torch.Tensor:
        """Adam's moments of `p` (state `step`, `exp_avg`, `exp_avg_sq`, made on first use) updated with `grad`,
        and m_hat / (sqrt(v_hat) + eps) (`eps_inside_sqrt`: m_hat / sqrt(v_hat + eps)) in `p`'s scratch buffer."""
        state = self.advance_moments(p, grad.dtype)
        step, (beta1, beta2) = int(state["step"]), betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step if bias_correction else 1.0
        bc2 = 1.0 - beta2**step if bias_correction else 1.0
        out = self.scratch(p)  # the denominator, then the result: as few passes over memory as the math allows
        if eps_inside_sqrt:
            torch.add(exp_avg_sq, eps * bc2, out=out).sqrt_()  # sqrt(v / bc2 + eps) = this / sqrt(bc2)
        else:
            torch.sqrt(exp_avg_sq, out=out)
            if bc2 != 1.0:
                out.mul_(1.0 / math.sqrt(bc2))
            out.add_(eps)
        torch.div(exp_avg, out, out=out)
        if eps_inside_sqrt and bc2 != 1.0:
            out.mul_(math.sqrt(bc2))
        return out if bc1 == 1.0 else out.mul_(1.0 / bc1)
