"""Build the optimizer and LR schedule a config names, plus our pure-PyTorch Lion.

Optimizer names map to classes through the registry (config/optimizers.py); this module imports the class,
checks params against its signature and builds it. `Lamb` is slipstream/optim/lamb.py's FusedLamb. It also
holds a small optimizer DeepSpeed ships as a fused kernel:
- `Lion` follows ops.lion: p *= 1 - lr * weight_decay; p -= lr * sign(beta1 * m + (1 - beta1) * g);
  m = beta2 * m + (1 - beta2) * g.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from slipstream.config.optimizers import REGISTRY, OptimizerSpec, spec_for
from slipstream.config.plan import OptimizerPlan, SchedulerPlan
from slipstream.engine.lr_schedules import SCHEDULES
from slipstream.engine.param_check import check_params
from slipstream.optim.common import closure_loss, math_dtype
from slipstream.optim.lamb import FusedLamb as Lamb

__all__ = ["Lamb", "Lion", "build_optimizer", "build_scheduler"]

Params = Iterable[Tensor] | Iterable[dict[str, Any]]


def _params_with_grads(param_groups: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], Tensor, Tensor]]:
    """(group, param, its gradient) for every param that has a gradient, in group order."""
    for group in param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p, p.grad


class Lion(torch.optim.Optimizer):
    """Lion (https://arxiv.org/abs/2302.06675) with decoupled weight decay, DeepSpeed FusedLion's arguments."""

    def __init__(
        self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0
    ) -> None:
        if lr < 0 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion needs lr >= 0 and betas in [0, 1); got lr={lr}, betas={betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group, p, p_grad in _params_with_grads(self.param_groups):
            beta1, beta2 = group["betas"]
            state, dtype = self.state[p], math_dtype(p)
            if not state:
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            grad, exp_avg = p_grad.to(dtype), state["exp_avg"]
            direction = (exp_avg * beta1 + grad * (1.0 - beta1)).sign_()
            weight = p.to(dtype, copy=True).mul_(1.0 - group["lr"] * group["weight_decay"])
            p.copy_(weight.sub_(direction, alpha=group["lr"]))
            exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss


def _accepted(cls: Any, skip: int = 1) -> list[str] | None:
    """Keyword names `cls(params, ...)` accepts after the params, or None when it takes **kwargs."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1 + skip :]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]


def _check_params(section: str, cls: type, params: dict[str, object], *, drop: tuple[str, ...] = ()) -> None:
    accepted = _accepted(cls)
    if accepted is None:
        return
    allowed = [name for name in accepted if name not in drop]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"{section}.params {unknown} not accepted by {cls.__module__}.{cls.__name__}; it accepts {allowed}"
        )
    check_params(section, cls, params)  # kinds and ranges, naming the dotted key


def _torch_fast(cls: Any, params: list[object], kwargs: dict[str, object]) -> torch.optim.Optimizer:
    """`cls` with fused=True where torch supports it for these params, else foreach=True (unless the user chose)."""
    accepted = _accepted(cls) or []
    if "fused" in kwargs or "foreach" in kwargs or "foreach" not in accepted:
        return cls(params, **kwargs)
    if "fused" in accepted:
        try:
            return cls(params, fused=True, **kwargs)
        except RuntimeError:  # torch has no fused kernel for these params' device or dtype
            pass
    return cls(params, foreach=True, **kwargs)


def _resolve_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _registry_class(spec: OptimizerSpec, on_host: bool) -> Any:
    if spec.min_torch is not None:
        have = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
        if have < spec.min_torch:
            raise ValueError(
                f"optimizer.type={spec.name!r} needs torch >= {spec.min_torch[0]}.{spec.min_torch[1]}; "
                f"this is torch {torch.__version__}. Upgrade torch or pick another optimizer"
            )
    return _resolve_target(spec.host_target if on_host and spec.host_target else spec.target)


def build_optimizer(plan: OptimizerPlan, params: Iterable[Any], *, on_host: bool) -> torch.optim.Optimizer:
    """The optimizer `plan` names over `params`, from the registry (config/optimizers.py).

    With `on_host` (optimizer offload) an entry's host kernel is used when it has one (adam/adamw ->
    DeepSpeedCPUAdam); torch.optim classes get fused=True where supported, else foreach=True.
    """
    param_list = list(params)
    kwargs = dict(plan.params)
    spec = spec_for(plan.name)
    if spec is None:
        found: Any = getattr(torch.optim, plan.name, None)
        if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)) or found is torch.optim.Optimizer:
            raise ValueError(
                f"optimizer.type={plan.name!r} is not supported; use one of {sorted(REGISTRY)} or a "
                "torch.optim class name spelled as in torch (e.g. 'RMSprop', 'NAdam')"
            )
        _check_params("optimizer", found, kwargs)
        return found(param_list, **kwargs)
    if spec.name == "muon":  # param groups split into Muon and AdamW halves (slipstream/optim/muon.py)
        from slipstream.optim.muon import build_muon

        return build_muon(param_list, kwargs)
    torch_adam = kwargs.pop("torch_adam", False) is True and spec.name in ("adam", "adamw")
    cls = _registry_class(spec, on_host)
    if getattr(cls, "writes_low_precision_copy", False):  # the CPU Adam op: Adam or AdamW by a flag
        _check_params("optimizer", cls, kwargs, drop=("adamw_mode",))
        return cls(param_list, adamw_mode=(plan.name == "adamw"), **kwargs)
    if torch_adam:  # DeepSpeed's "torch_adam": true builds torch's own class
        cls = torch.optim.AdamW if spec.name == "adamw" else torch.optim.Adam
    elif spec.name in ("adam", "adamw"):  # FusedAdam: Adam or AdamW by adam_w_mode
        kwargs.setdefault("adam_w_mode", spec.name == "adamw")  # resolve() folds the config's into the name
        _check_params("optimizer", cls, kwargs)
        return cls(param_list, **kwargs)
    accepted = _accepted(cls)
    if "bias_correction" in kwargs and accepted is not None and "bias_correction" not in accepted:
        if kwargs.pop("bias_correction") is not True:  # DeepSpeed's Adam key; torch's Adam always corrects
            raise ValueError(
                f"optimizer.params.bias_correction=False is only supported with CPU offload "
                f"(DeepSpeedCPUAdam); {cls.__name__} always bias-corrects. Remove the key"
            )
    _check_params("optimizer", cls, kwargs)
    return (
        _torch_fast(cls, param_list, kwargs) if cls.__module__.startswith("torch.optim") else cls(param_list, **kwargs)
    )


def _torch_schedulers() -> list[str]:
    sched = torch.optim.lr_scheduler
    return sorted(
        n
        for n in dir(sched)
        if isinstance(getattr(sched, n), type)
        and n != "LRScheduler"
        and (issubclass(getattr(sched, n), sched.LRScheduler) or n == "ReduceLROnPlateau")
    )


def build_scheduler(plan: SchedulerPlan, optimizer: torch.optim.Optimizer) -> Any:
    """The LR schedule `plan` names: DeepSpeed's lr_schedules first, else torch.optim.lr_scheduler.<name>."""
    cls: Any = SCHEDULES.get(plan.name)
    if cls is None and plan.name in _torch_schedulers():
        cls = getattr(torch.optim.lr_scheduler, plan.name)
    if cls is None:
        raise ValueError(
            f"scheduler.type={plan.name!r} is not supported; use one of {sorted(SCHEDULES)} or a "
            f"torch.optim.lr_scheduler class: {_torch_schedulers()}"
        )
    _check_params("scheduler", cls, dict(plan.params))
    accepted = _accepted(cls) or []
    init: Any = cls.__init__
    required = [
        p.name
        for p in list(inspect.signature(init).parameters.values())[2:]
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    missing = [name for name in required if name in accepted and name not in plan.params]
    if missing:
        raise ValueError(
            f"scheduler.params is missing {missing}, required by {cls.__name__}; add them to the "
            "'scheduler.params' section of the config"
        )
    return cls(optimizer, **plan.params)
