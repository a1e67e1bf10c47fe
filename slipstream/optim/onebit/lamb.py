"""1-bit LAMB (https://arxiv.org/abs/2104.06069) with DeepSpeed OnebitLamb's arguments and defaults.

Steps 1..freeze_step are the warm-up: the engine all-reduces the gradients and each tensor takes a LAMB step as
DeepSpeed's 1-bit LAMB computes it (no bias correction):
    u = m / (sqrt(v) + eps) + weight_decay * w;  c = clamp(||w|| / ||u||, min_coeff, max_coeff)  (1 if a norm is 0)
    w -= lr * c * u;  and, when c != 1, frozen_c = coeff_beta * frozen_c + (1 - coeff_beta) * c
After it the variance v and the coefficient frozen_c stop moving. Each step updates this rank's momentum with its
own gradient and replaces it by its 1-bit error-compensated mean over the ranks (comm/compressed/). From the mean
momentum and the last one a gradient is reconstructed, g = (m - beta1 m_last) / (1 - beta1), which feeds a fresh
variance v_fresh (started from v at the end of the warm-up). The step is
    factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))        the largest elementwise ratio
    (with weight decay: factor = factor * r + 1 - r, r = min(1, ||m / (sqrt(v) + eps)|| / ||u||))
    factor clamped to [factor_min, factor_max], then to last_factor * [1 - factor_threshold, 1 + factor_threshold]
    w -= lr * frozen_c * factor * u
ZeRO 0 hands the optimizer flat pieces that hold several parameters; as FusedLamb does, the coefficients are per
parameter through the whole-tensor map ([Note: whole-tensor map] in zero/whole_tensors.py), and each piece's
momentum is compressed as one buffer. So, as DeepSpeed does for its one flat buffer, the first compressed step
records each tensor's 'scaling_coeff' (the mean over the piece's tensors of ||m|| / sqrt(numel), divided by the
tensor's own), and every compressed step multiplies the momentum by it before the all-reduce and divides after.
As in OneBitAdam, DeepSpeed's first step only sets up its buffers; here every step updates the parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from slipstream.optim.arguments import bind, takes
from slipstream.optim.common import closure_loss
from slipstream.optim.lamb import LambCoeffs, trust_ratios
from slipstream.optim.onebit.base import FreezeStepArguments, OneBitBase, Params, adam_update
from slipstream.zero.whole_tensors import TensorPart, WholeTensorMap

__all__ = ["OneBitLamb"]

PER_TENSOR = ("lamb_coeff_freeze", "last_factor", "scaling_coeff")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneBitLambArguments(FreezeStepArguments):
    ORDER: ClassVar[tuple[str, ...]] = (
        "lr", "freeze_step", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay",
        "max_grad_norm", "max_coeff", "min_coeff", "amsgrad", "cuda_aware", "comm_backend_name", "coeff_beta",
        "factor_max", "factor_min", "factor_threshold",
    )  # fmt: skip
    GROUP_KEYS: ClassVar[tuple[str, ...]] = (*FreezeStepArguments.GROUP_KEYS, "max_coeff", "min_coeff")
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    """The warm-up trust ratio's clamp: [min_coeff, max_coeff]."""
    coeff_beta: float = 0.9
    """The weight of the running average of the warm-up's trust ratios (the frozen ratio)."""
    factor_max: float = 4.0
    factor_min: float = 0.5
    """The compressed steps' variance factor's clamp: [factor_min, factor_max]."""
    factor_threshold: float = 0.1
    """How far (a fraction) the factor may move from the last step's."""

    def problems(self) -> list[str]:
        out = super().problems()
        if not 0.0 < self.min_coeff <= self.max_coeff:
            out.append(f"needs 0 < min_coeff <= max_coeff; got min_coeff={self.min_coeff}, max_coeff={self.max_coeff}")
        if not 0.0 <= self.coeff_beta < 1.0:
            out.append(f"coeff_beta={self.coeff_beta} must be in [0, 1) (the coefficient's running-average weight)")
        if not 0.0 < self.factor_min <= self.factor_max or self.factor_threshold < 0.0:
            out.append(
                f"needs 0 < factor_min <= factor_max and factor_threshold >= 0; got factor_min={self.factor_min}, "
                f"factor_max={self.factor_max}, factor_threshold={self.factor_threshold}"
            )
        return out


class OneBitLamb(LambCoeffs, OneBitBase):
    """1-bit LAMB; `deepspeed` (DeepSpeed's engine argument) is accepted and unused: the engine asks the optimizer
    instead (`takes_over_reduction`). `bias_correction`, `eps_inside_sqrt` and `max_grad_norm` are accepted as in
    DeepSpeed, whose 1-bit LAMB does not use them either. `lamb_coeffs` holds the last step's coefficients. The
    other arguments: OneBitLambArguments."""

    coeff_beta: float
    factor_max: float
    factor_min: float
    factor_threshold: float

    zero_refusal = (
        "it scales each tensor's whole momentum before compressing it and rebuilds the gradient from the whole "
        "compressed momentum, and a sharded stage holds only a shard of the momentum"
    )

    @takes(OneBitLambArguments)
    def __init__(self, params: Params, deepspeed: object = None, *args: object, **kwargs: object) -> None:
        super().__init__(without_empty(params), bind(OneBitLambArguments, args, kwargs))
        self.lamb_coeffs = []
        self._per_tensor: dict[Tensor, dict[str, Tensor]] = {}
        """Per piece, one float64 value per tensor in it (PER_TENSOR); checkpointed with the error buffers."""

    lamb_freeze_key = OneBitBase.warmup_over

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        compressed = self.next_step_is_local()
        whole = self.whole_tensors()
        self.lamb_coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("OneBitLamb does not support sparse gradients (nor does DeepSpeed's)")
                parts = whole.parts(p)
                state = self.adam_state(p)
                if p not in self._per_tensor:
                    zeros = torch.zeros(len(parts), dtype=torch.float64)
                    self._per_tensor[p] = {"lamb_coeff_freeze": zeros, "last_factor": torch.ones_like(zeros)}
                state["step"] += 1
                step = self._compressed_step if compressed else self._warmup_step
                coeffs = step(p, group, state, whole).tolist()
                self.lamb_coeffs += coeffs
                flat_p, flat_u = p.view(-1), self.work_buffer(p).view(-1)
                for part, coeff in zip(parts, coeffs):
                    end = part.offset + part.numel
                    flat_p[part.offset : end].sub_(flat_u[part.offset : end], alpha=group["lr"] * coeff)
        return loss

    def _warmup_step(self, p: Tensor, group: dict[str, Any], state: dict[str, Any], whole: WholeTensorMap) -> Tensor:
        """A LAMB step's moments, u in `work_buffer(p)`, and each tensor's coefficient (folded into the frozen
        ones)."""
        beta1, beta2 = group["betas"]
        grad, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
        assert grad is not None  # step() skips parameters without one
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        update = adam_update(p, exp_avg, exp_avg_sq, group, self.work_buffer(p))
        norms = self._norms(whole, p, [p, update])
        coeffs = trust_ratios(norms, *self._limits(group, norms.device)).cpu()
        per = self._per_tensor[p]
        frozen = per["lamb_coeff_freeze"]
        blended = frozen * self.coeff_beta + coeffs * (1.0 - self.coeff_beta)
        per["lamb_coeff_freeze"] = torch.where(coeffs != 1.0, blended, frozen)
        return coeffs

    def _compressed_step(
        self, p: Tensor, group: dict[str, Any], state: dict[str, Any], whole: WholeTensorMap
    ) -> Tensor:
        """A compressed step: the mean momentum, the fresh variance, u in `work_buffer(p)`, frozen_c * factor."""
        beta1, beta2 = group["betas"]
        grad, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
        assert grad is not None  # step() skips parameters without one
        parts, per = whole.parts(p), self._per_tensor[p]
        if "exp_avg_sq_fresh" not in state:  # the first compressed step: the warm-up's last variance
            state["exp_avg_sq_fresh"] = exp_avg_sq.clone()
        if "scaling_coeff" not in per:
            per["scaling_coeff"] = _scaling_coeffs(exp_avg, parts)
        fresh = state["exp_avg_sq_fresh"]
        rebuilt = self.work_buffer(p, slot=1).copy_(exp_avg)
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        _scale_parts(exp_avg, parts, per["scaling_coeff"])
        self.compressed_mean(p, exp_avg)
        _scale_parts(exp_avg, parts, per["scaling_coeff"].reciprocal())
        rebuilt.mul_(-beta1).add_(exp_avg).div_(1.0 - beta1)  # the gradient the mean momentum implies
        fresh.mul_(beta2).addcmul_(rebuilt, rebuilt, value=1.0 - beta2)
        denom = torch.sqrt(exp_avg_sq, out=self.work_buffer(p)).add_(group["eps"])
        ratio = torch.div(denom, torch.sqrt(fresh, out=rebuilt).add_(group["eps"]), out=rebuilt).view(-1)
        factor = torch.stack([ratio[part.offset : part.offset + part.numel].max() for part in parts]).double().cpu()
        update = torch.div(exp_avg, denom, out=denom)
        if group["weight_decay"] > 0.0:
            decayed = torch.add(update, p, alpha=group["weight_decay"], out=rebuilt)
            norms = self._norms(whole, p, [update, decayed]).cpu()
            share = torch.where(norms[:, 1] > 0, norms[:, 0] / norms[:, 1].clamp_min(1e-300), 1.0).clamp(max=1.0)
            factor = factor * share + (1.0 - share)
            update.copy_(decayed)
        return per["lamb_coeff_freeze"] * self._limited(factor, per)

    def _limited(self, factor: Tensor, per: dict[str, Tensor]) -> Tensor:
        """Each factor clamped to [factor_min, factor_max], then within factor_threshold of its last one (kept)."""
        factor = factor.clamp(self.factor_min, self.factor_max)
        last, threshold = per["last_factor"], self.factor_threshold
        factor = torch.minimum(torch.maximum(factor, last * (1.0 - threshold)), last * (1.0 + threshold))
        per["last_factor"] = factor
        return factor

    # ---- checkpoints: the per-tensor values travel with the error buffers (not in `state`, whose tensors
    # load_state_dict casts to the piece's dtype and whose values engine checkpoints keep per element or scalar)
    def rank_tensors(self) -> dict[str, Tensor]:
        out = super().rank_tensors()
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                for name, values in self._per_tensor.get(p, {}).items():
                    out[f"{g}.{i}.{name}"] = values
        return out

    def load_rank_tensors(self, tensors: dict[str, Tensor], *, saved_world_size: int) -> None:
        """The frozen ratios, last factors and scaling coefficients (at any world size; none when the loaded step
        is still in the warm-up, which starts them again, as DeepSpeed's load does), then the errors."""
        self._per_tensor.clear()
        for g, group in enumerate(self.param_groups if self.next_step_is_local() else []):
            for i, p in enumerate(group["params"]):
                found = {n: tensors[f"{g}.{i}.{n}"] for n in PER_TENSOR if f"{g}.{i}.{n}" in tensors}
                if found:
                    self._per_tensor[p] = {n: v.detach().to("cpu", torch.float64, copy=True) for n, v in found.items()}
        errors = {key: value for key, value in tensors.items() if key.rsplit(".", 1)[-1] not in PER_TENSOR}
        super().load_rank_tensors(errors, saved_world_size=saved_world_size)

    @staticmethod
    def _norms(whole: WholeTensorMap, p: Tensor, values: list[Tensor]) -> Tensor:
        """Per tensor in `p` (its parts' order), the norms of `values` (one column each)."""
        rows = [part.tensor for part in whole.parts(p)]
        return whole.sum_squares([(p, values)])[rows].sqrt()

    @staticmethod
    def _limits(group: dict[str, Any], device: torch.device) -> tuple[Tensor, Tensor]:
        limits = torch.tensor([group["min_coeff"], group["max_coeff"]], dtype=torch.float64, device=device)
        return limits[0], limits[1]


def without_empty(params: Params) -> Params:
    """`params` less the parameters with no elements, and less the groups left with none, as DeepSpeed's 1-bit
    LAMB filters them: a tensor of 0 elements has no norm to scale the momentum by."""
    listed: list[Any] = list(params)
    if not listed or not isinstance(listed[0], dict):
        return [p for p in listed if p.numel() > 0]
    groups = []
    for group in listed:
        given = group["params"]
        kept = [p for p in ([given] if isinstance(given, Tensor) else given) if p.numel() > 0]
        if kept:
            groups.append({**group, "params": kept})
    return groups


def _scaling_coeffs(exp_avg: Tensor, parts: tuple[TensorPart, ...]) -> Tensor:
    """Per tensor, the mean over the piece's tensors of ||m|| / sqrt(numel), divided by its own (1 where its
    momentum is 0): the compressed piece then holds tensors of one size."""
    flat = exp_avg.view(-1)
    scales = torch.stack(
        [
            torch.linalg.vector_norm(flat[part.offset : part.offset + part.numel]).double() / part.numel**0.5
            for part in parts
        ]
    ).cpu()
    return torch.where(scales > 0, scales.mean() / scales.clamp_min(1e-300), 1.0)


def _scale_parts(values: Tensor, parts: tuple[TensorPart, ...], coeffs: Tensor) -> None:
    flat = values.view(-1)
    for part, coeff in zip(parts, coeffs.tolist()):
        flat[part.offset : part.offset + part.numel].mul_(coeff)
