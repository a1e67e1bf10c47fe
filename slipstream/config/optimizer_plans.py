"""The `optimizer` and `scheduler` sections as plans: DeepSpeed's names over the registry (config/optimizers.py)
or torch's classes, DeepSpeed's optimizer defaults filled in, an unknown name an error with the closest match."""

from __future__ import annotations

import difflib

from slipstream.config.optimizers import DEEPSPEED_ONLY, REGISTRY, spec_for
from slipstream.config.plan import OptimizerPlan, SchedulerPlan
from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["DEEPSPEED_SCHEDULERS", "optimizer_plan", "scheduler_plan"]
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def optimizer_plan(cfg: DeepSpeedConfig, problems: list[str]) -> OptimizerPlan | None:
    """DeepSpeed's `_configure_basic_optimizer` naming over the registry (config/optimizers.py): its names
    lower-cased, torch.optim names as given; DeepSpeed's defaults filled in."""
    if cfg.optimizer is None:
        return None
    given, params = cfg.optimizer.type, dict(cfg.optimizer.params)
    if "max_grad_norm" in params:
        problems.append(
            "optimizer.params.max_grad_norm: not supported; use the top-level "
            f'"gradient_clipping": {params["max_grad_norm"]!r} instead'
        )
    lower = given.lower()
    spec = spec_for(given)
    if lower in DEEPSPEED_ONLY:
        return OptimizerPlan(name=lower, params=params)
    if spec is None and _torch_class("optim", given):
        return OptimizerPlan(name=given, params=params)
    if spec is None:
        names = [*(n for n in REGISTRY if n.islower()), *DEEPSPEED_ONLY]
        close = difflib.get_close_matches(lower, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        problems.append(
            f"optimizer.type: unknown optimizer {given!r}; {hint}use a DeepSpeed name (adam, adamw, "
            "lamb, lion, adagrad, ...) or a torch.optim class name such as 'SGD' (case-sensitive)"
        )
        return None
    name = spec.name
    torch_defaults = False
    if name in ("adam", "adamw"):
        torch_defaults = params.pop("torch_adam", False)
        adam_w_mode = params.pop("adam_w_mode", True)
        for key, value in (("torch_adam", torch_defaults), ("adam_w_mode", adam_w_mode)):
            if not isinstance(value, bool):
                problems.append(f"optimizer.params.{key}: expected a boolean (true or false), got {value!r}")
        name = "adamw" if name == "adamw" or adam_w_mode is not False else "adam"
        spec = REGISTRY[name]
    # [Note: optimizer defaults] in config/optimizers.py
    defaults = {} if torch_defaults is True else dict(spec.defaults)
    if torch_defaults is True:  # the engine builds torch.optim's Adam/AdamW instead of FusedAdam
        params["torch_adam"] = True
    return OptimizerPlan(name=name, params={**defaults, **params})


def _torch_class(module: str, name: str) -> bool:
    import torch.optim
    import torch.optim.lr_scheduler

    found = getattr(torch.optim if module == "optim" else torch.optim.lr_scheduler, name, None)
    return isinstance(found, type)


def scheduler_plan(cfg: DeepSpeedConfig, problems: list[str]) -> SchedulerPlan | None:
    if cfg.scheduler is None:
        return None
    name = cfg.scheduler.type
    if name not in DEEPSPEED_SCHEDULERS and not _torch_class("lr_scheduler", name):
        close = difflib.get_close_matches(name, DEEPSPEED_SCHEDULERS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        problems.append(
            f"scheduler.type: unknown scheduler {name!r}; {hint}use one of "
            f"{', '.join(DEEPSPEED_SCHEDULERS)} or a torch.optim.lr_scheduler class name"
        )
        return None
    return SchedulerPlan(name=name, params=dict(cfg.scheduler.params))
