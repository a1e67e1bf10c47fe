"""`FusedAdam`: DeepSpeed's device Adam/AdamW class, as torch's fused (or foreach) Adam kernels.

DeepSpeed builds `deepspeed.ops.adam.FusedAdam` for a config's `"Adam"` / `"AdamW"` without offload, and
client code checks the optimizer `initialize()` returns with `isinstance(..., FusedAdam)`. Here the class is
a `torch.optim.Adam` (torch's fused kernel where it supports the parameters' device and dtype, else foreach),
with DeepSpeed's constructor: `adam_w_mode` chooses decoupled weight decay (AdamW, the default) or L2 (Adam),
and `weight_decay` defaults to 0. torch's own keyword arguments (`foreach`, `fused`, `maximize`, ...) are
accepted too; `amsgrad=True` works (torch's AMSGrad) where DeepSpeed's kernel refuses it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["FusedAdam"]

# torch.optim.Adam(decoupled_weight_decay=...) arrived in torch 2.6; before it FusedAdam decays the weights itself
# (p *= 1 - lr * weight_decay before the Adam update with no L2 term: AdamW's math, as torch's AdamW does it).
_TORCH_DECOUPLES = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


class FusedAdam(torch.optim.Adam):
    """Adam (`adam_w_mode=False`) or AdamW (`adam_w_mode=True`, the default) with DeepSpeed's arguments."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if bias_correction is not True:
            raise ValueError(
                "FusedAdam(bias_correction=False) (optimizer.params.bias_correction) is only supported with CPU "
                "offload (DeepSpeedCPUAdam); torch's Adam kernels always bias-correct. Remove the key"
            )
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        param_list: list[Any] = list(params)  # tried twice below (fused, then foreach)
        common: dict[str, Any] = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
        )
        self._decay_here = self.adam_w_mode and not _TORCH_DECOUPLES
        if _TORCH_DECOUPLES:
            common["decoupled_weight_decay"] = self.adam_w_mode
        if fused is not None or foreach is not None or differentiable:
            super().__init__(param_list, foreach=foreach, fused=fused, **common)
        else:
            try:
                super().__init__(param_list, fused=True, **common)
            except RuntimeError:  # no fused kernel for these parameters' device or dtype
                super().__init__(param_list, foreach=True, **common)
        if not _TORCH_DECOUPLES:  # record the mode where newer torch keeps it, for code that reads the groups
            self.defaults["decoupled_weight_decay"] = self.adam_w_mode
            for group in self.param_groups:
                group["decoupled_weight_decay"] = self.adam_w_mode

    @torch.no_grad()
    def step(self, closure: object = None) -> Any:
        if not self._decay_here:
            return super().step(closure)
        decays = [group["weight_decay"] for group in self.param_groups]
        for group, decay in zip(self.param_groups, decays, strict=True):
            if decay:
                for param in group["params"]:
                    if param.grad is not None:
                        param.mul_(1 - group["lr"] * decay)
            group["weight_decay"] = 0.0
        try:
            return super().step(closure)
        finally:
            for group, decay in zip(self.param_groups, decays, strict=True):
                group["weight_decay"] = decay

    def zero_grad(self, set_to_none: bool | None = None) -> None:  # type: ignore[override, unused-ignore]
        """DeepSpeed's FusedAdam: gradients become None when `set_grad_none` (the default), else zeros."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
