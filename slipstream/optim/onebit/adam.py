"""1-bit Adam (https://arxiv.org/abs/2102.02888) with DeepSpeed OnebitAdam's arguments and defaults.

Steps 1..freeze_step are the warm-up: the engine all-reduces the gradients and the update is Adam's as DeepSpeed's
1-bit Adam computes it (m / (sqrt(v) + eps) without bias correction, plus weight_decay * p). After it the variance
is frozen and each step communicates the momentum instead of the gradient: this rank's momentum is updated with
its own gradient, then replaced by its 1-bit error-compensated mean over the ranks (comm/compressed/).
At ZeRO stage 1 the optimizer state is sharded, so no rank holds a whole momentum to compress: after the warm-up
the ZeRO optimizer compresses each bucket's gradient instead (the same all-reduce, one pair of error buffers per
bucket; [Note: 1-bit gradients at stage 1] in zero/stage1.py) and each rank's momentum takes the mean gradient.
DeepSpeed's first step only initialises its communication buffers and leaves the parameters alone; here every
step updates them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from slipstream.optim.arguments import bind, takes
from slipstream.optim.common import closure_loss
from slipstream.optim.onebit.base import FreezeStepArguments, OneBitBase, Params, adam_update

__all__ = ["OneBitAdam"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneBitAdamArguments(FreezeStepArguments):
    ORDER: ClassVar[tuple[str, ...]] = (
        "lr", "freeze_step", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay",
        "max_grad_norm", "amsgrad", "cuda_aware", "comm_backend_name",
    )  # fmt: skip


class OneBitAdam(OneBitBase):
    """1-bit Adam; `deepspeed` (DeepSpeed's engine argument) is accepted and unused: the engine asks the optimizer
    instead (`takes_over_reduction`). `bias_correction`, `eps_inside_sqrt` and `max_grad_norm` are accepted as in
    DeepSpeed, whose 1-bit Adam does not use them either. The other arguments: OneBitAdamArguments."""

    zero_stages = (0, 1)

    @takes(OneBitAdamArguments)
    def __init__(self, params: Params, deepspeed: object = None, *args: object, **kwargs: object) -> None:
        super().__init__(params, bind(OneBitAdamArguments, args, kwargs))
        self._gaps: dict[Tensor, Tensor] = {}

    adam_freeze_key = OneBitBase.warmup_over

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        compressed = self.next_step_is_local()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.adam_state(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                if compressed and not self.compresses_gradients():
                    self.compressed_mean(p, exp_avg)  # masked there ([Note: exp_avg_mask] in base.py)
                    self._zero_padding(p, exp_avg)
                elif compressed:  # ZeRO 1: the ZeRO optimizer compressed the gradient
                    self.apply_exp_avg_mask(p, exp_avg)
                else:
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                p.sub_(adam_update(p, exp_avg, exp_avg_sq, group, self.work_buffer(p)), alpha=group["lr"])
        return loss

    def _zero_padding(self, p: Tensor, values: Tensor) -> None:
        """Zero `values` where `p` (a ZeRO-0 piece) holds no parameter: the compressed mean writes scale * sign
        there too, and a checkpoint keeps only the parameters' elements, so a resume would start those at 0."""
        gaps = self._gaps.get(p)
        if gaps is None:
            covered = torch.zeros(p.numel(), dtype=torch.bool, device=p.device)
            for part in self.whole_tensors().parts(p):
                covered[part.offset : part.offset + part.numel] = True
            gaps = self._gaps[p] = torch.nonzero(~covered).view(-1)
        if gaps.numel():
            values.view(-1).index_fill_(0, gaps, 0.0)
