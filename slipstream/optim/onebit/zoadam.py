"""0/1 Adam (https://arxiv.org/abs/2202.06009) with DeepSpeed ZeroOneAdam's arguments and defaults.

Two phases, by the step number s (1-based):
- Variance phase (s <= var_freeze_step + 1). The variance is updated on steps where s % var_interval == 0,
  with the engine's all-reduced gradient (a full-precision step: Adam's update as in adam.py). On the other
  steps the engine hands over this rank's gradient, the gradient's 1-bit mean updates the momentum only.
  var_interval starts at 1 and doubles every var_update_scaler variance updates, so the first
  var_update_scaler steps are plain (uncorrected) Adam.
- Frozen phase (after it; the error buffers restart from zero). Each step is local: the momentum takes this
  rank's gradient, the parameters move by lr * update and the accumulator u collects -lr * update. Every
  local_step_interval steps the ranks synchronise: the local moves are undone, u * (sqrt(v) + eps) goes
  through the 1-bit mean, the momentum becomes -u / (sum of the window's lr) and the parameters move by
  u / (sqrt(v) + eps). local_step_interval starts at 1 and doubles every local_step_scaler steps, up to
  local_step_clipper.
The counters are per-parameter state scalars, so checkpoints keep them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from slipstream.optim.arguments import bind, takes
from slipstream.optim.common import closure_loss
from slipstream.optim.onebit.base import OneBitArguments, OneBitBase, Params, adam_update

__all__ = ["ZeroOneAdam"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroOneAdamArguments(OneBitArguments):
    ORDER: ClassVar[tuple[str, ...]] = (
        "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
        "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "amsgrad",
        "cuda_aware", "comm_backend_name",
    )  # fmt: skip
    var_freeze_step: int = 100000
    """The last step of the variance phase (see the module's docstring)."""
    var_update_scaler: int = 16
    """Variance updates between doublings of the interval between them."""
    local_step_scaler: int = 32678
    """Frozen-phase steps between doublings of the interval between synchronisations."""
    local_step_clipper: int = 16
    """The largest interval between synchronisations."""

    def problems(self) -> list[str]:
        out = super().problems()
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            if getattr(self, key) < 1:
                out.append(f"{key}={getattr(self, key)} must be >= 1")
        return out


class ZeroOneAdam(OneBitBase):
    """0/1 Adam; `deepspeed`, `bias_correction`, `eps_inside_sqrt` and `max_grad_norm` are accepted and unused,
    as in DeepSpeed (see OneBitAdam). The other arguments: ZeroOneAdamArguments."""

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int

    zero_refusal = (
        "its variance-phase and local steps compress this rank's whole gradient, momentum and accumulated update "
        "on steps where the ranks do not all-reduce, and a sharded stage holds only a shard of that state"
    )

    @takes(ZeroOneAdamArguments)
    def __init__(self, params: Params, deepspeed: object = None, *args: object, **kwargs: object) -> None:
        super().__init__(params, bind(ZeroOneAdamArguments, args, kwargs))

    def _counters(self) -> dict[str, Any]:
        """The first parameter's state (every parameter keeps the same counters)."""
        return self.first_state() or {"step": 0, "var_interval": 1}

    def _frozen(self, step: int) -> bool:
        return step > self.var_freeze_step + 1

    def next_step_is_local(self) -> bool:
        counters = self._counters()
        upcoming = int(counters["step"]) + 1
        return self._frozen(upcoming) or upcoming % int(counters["var_interval"]) != 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        upcoming = int(self._counters()["step"]) + 1
        if self._frozen(upcoming) and not self._frozen(upcoming - 1):
            self.reset_errors()  # the errors now measure the accumulated update, not the gradient
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self._state_of(p)
                    state["step"] += 1
                    if self._frozen(state["step"]):
                        self._local_step(p, state, group)
                    else:
                        self._variance_phase_step(p, state, group)
        return loss

    def _state_of(self, p: Tensor) -> dict[str, Any]:
        state = self.adam_state(p)
        if "var_interval" not in state:
            state.update(var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0)
            state["lrs"] = torch.zeros((), dtype=torch.float64)  # a float64 tensor: checkpoints restore it exactly
            state["momentum_accumulator"] = torch.zeros_like(p)
        return state

    def _variance_phase_step(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
        assert grad is not None
        if state["step"] % state["var_interval"] == 0:
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            state["var_counter"] += 1
            if state["var_counter"] == self.var_update_scaler:
                state["var_counter"] = 0
                state["var_interval"] *= 2
        else:
            self.compressed_mean(p, grad)
            exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        p.sub_(adam_update(p, exp_avg, exp_avg_sq, group, self.work_buffer(p)), alpha=group["lr"])

    def _local_step(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1 = group["betas"][0]
        exp_avg, exp_avg_sq, accumulated = state["exp_avg"], state["exp_avg_sq"], state["momentum_accumulator"]
        assert p.grad is not None
        exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
        state["lrs"] += group["lr"]
        move = adam_update(p, exp_avg, exp_avg_sq, group, self.work_buffer(p)).mul_(-group["lr"])
        p.add_(move)
        accumulated.add_(move)
        if state["step"] % state["local_step_interval"] == 0:
            denom = torch.sqrt(exp_avg_sq, out=move).add_(group["eps"])
            p.sub_(accumulated)
            accumulated.mul_(denom)
            self.compressed_mean(p, accumulated)
            exp_avg.copy_(accumulated).div_(-state["lrs"])
            p.add_(torch.div(accumulated, denom, out=denom))
            accumulated.zero_()
            state["lrs"].zero_()
        state["local_step_counter"] += 1
        if state["local_step_counter"] == self.local_step_scaler:
            state["local_step_counter"] = 0
            state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
