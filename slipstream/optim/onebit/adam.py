"""1-bit Adam (https://arxiv.org/abs/2102.02888) with DeepSpeed OnebitAdam's arguments and defaults.

Steps 1..freeze_step are the warm-up: the engine all-reduces the gradients and the update is Adam's as DeepSpeed's
1-bit Adam computes it (m / (sqrt(v) + eps) without bias correction, plus weight_decay * p). After it the variance
is frozen and each step communicates the momentum instead of the gradient: this rank's momentum is updated with
its own gradient, then replaced by its 1-bit error-compensated mean over the ranks (comm/compressed/).
DeepSpeed's first step only initialises its communication buffers and leaves the parameters alone; here every
step updates them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slipstream.optim.common import closure_loss
from slipstream.optim.onebit.base import OneBitBase, Params, adam_defaults, adam_update

__all__ = ["OneBitAdam"]


class OneBitAdam(OneBitBase):
    """1-bit Adam; `deepspeed` (DeepSpeed's engine argument) is accepted and unused: the engine asks the optimizer
    instead (`takes_over_reduction`). `bias_correction`, `eps_inside_sqrt` and `max_grad_norm` are accepted as in
    DeepSpeed, whose 1-bit Adam does not use them either."""

    label = "OneBitAdam"

    def __init__(
        self,
        params: Params,
        deepspeed: object = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        if freeze_step < 0:
            raise ValueError(f"OneBitAdam: freeze_step={freeze_step} must be >= 0 (the number of warm-up steps)")
        defaults = adam_defaults(lr, bias_correction, betas, eps, weight_decay, max_grad_norm)
        super().__init__(params, defaults, amsgrad=amsgrad, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name)
        self.freeze_step = freeze_step

    def next_step_is_local(self) -> bool:
        return self.steps_done() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        compressed = self.next_step_is_local()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                if compressed:
                    self.compressed_mean(p, exp_avg)
                else:
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                p.sub_(adam_update(p, exp_avg, exp_avg_sq, group, self.work_buffer(p)), alpha=group["lr"])
        return loss
