"""TEMPORARY: the names Transformers, Accelerate and PEFT use that Slipstream's `deepspeed` does not provide yet,
filled for the tests (each recorded in SHIMMED).
Delete an entry when the surface has it; delete this file when SHIMMED stays empty."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

SHIMMED: list[str] = []


def _missing(module: str, attr: str) -> bool:
    try:
        return not hasattr(importlib.import_module(module), attr)
    except ImportError:
        return True


def _fill(module: str, attr: str, value: Any) -> None:
    """Give `module.attr` (the module created when it does not import) and record it."""
    if not _missing(module, attr):
        return
    try:
        target = importlib.import_module(module)
    except ImportError:
        target = types.ModuleType(module)
        sys.modules[module] = target
        parent, _, leaf = module.rpartition(".")
        setattr(importlib.import_module(parent), leaf, target)
    setattr(target, attr, value)
    SHIMMED.append(f"{module}.{attr}")


def _accepts_inf_steps_per_print() -> bool:
    from slipstream.config import ConfigError, resolve

    try:
        resolve({"train_batch_size": 1, "steps_per_print": float("inf")}, world_size=1)
    except ConfigError as exc:
        return "steps_per_print" not in str(exc)
    return True


def _attribute_path(root: Any, path: str) -> None:
    """`deepspeed.a.b` as an attribute chain after only `import deepspeed` (DeepSpeed imports them eagerly)."""
    obj: Any = root
    for part in path.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            importlib.import_module(path)  # the import system sets each module on its parent
            SHIMMED.append(f"{path} as an attribute of `import deepspeed`")
            return


def fill() -> list[str]:
    """Fill what is missing (once per process); returns the filled names."""
    if getattr(fill, "done", False):
        return SHIMMED
    fill.done = True  # type: ignore[attr-defined]
    import deepspeed
    import torch.distributed as dist

    from slipstream.engine.engine import SlipstreamEngine

    for path in (
        "deepspeed.runtime.lr_schedules",
        "deepspeed.runtime.zero",
        "deepspeed.zero",
        "deepspeed.comm",
        "deepspeed.utils",
        "deepspeed.checkpoint.utils",
        "deepspeed.ops.adam",
    ):
        _attribute_path(deepspeed, path)  # Accelerate reads deepspeed.runtime.lr_schedules.X with no import
    for name in ("get_rank", "get_world_size"):  # Transformers' initialize_weights_zero3 calls get_rank
        _fill("deepspeed.comm", name, getattr(dist, name))
    from slipstream.utils.logging import get_logger

    _fill("deepspeed.utils.logging", "logger", get_logger())  # Lightning sets its level
    _fill("deepspeed.launcher.runner", "DEEPSPEED_ENVIRONMENT_NAME", ".deepspeed_env")  # accelerate launch imports it
    if not hasattr(SlipstreamEngine, "zero_cpu_offload"):
        SlipstreamEngine.zero_cpu_offload = lambda self: self.plan.zero.offload_optimizer is not None  # type: ignore
        SHIMMED.append("DeepSpeedEngine.zero_cpu_offload")
    if not _accepts_inf_steps_per_print():
        real = deepspeed.initialize

        def initialize(*args: Any, config: Any = None, config_params: Any = None, **kwargs: Any) -> Any:
            cfg = config if config is not None else config_params
            if isinstance(cfg, dict) and cfg.get("steps_per_print") == float("inf"):
                cfg = {**cfg, "steps_per_print": 2**31}  # Accelerate always writes inf ("never")
            return real(*args, config=cfg, **kwargs)

        deepspeed.initialize = initialize
        SHIMMED.append("steps_per_print=inf accepted")
    return SHIMMED
