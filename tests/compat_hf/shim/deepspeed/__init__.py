"""TEMPORARY, test-only stand-in for the opt-in `deepspeed` compat distribution (issue 16, branch compat-surface).

It is put on sys.path only by tests/compat_hf (never installed, never imported by the package) when no
`deepspeed` that maps to Slipstream is installed. It makes `import deepspeed` give Slipstream's API and fills the
names Transformers, Accelerate and PEFT use that Slipstream does not provide yet. Every filled name is listed in
SHIMMED, so a test can report which of them the real distribution still lacks. Remove it once compat-surface lands.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import slipstream

__version__ = "0.19.8"
SHIMMED: list[str] = []
"""The names this file had to provide because Slipstream has none (module paths and attributes)."""


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, module)
    SHIMMED.append(name)
    return module


def _alias(name: str, target: str) -> types.ModuleType:
    module = importlib.import_module(target)
    sys.modules[name] = module
    parent, _, leaf = name.rpartition(".")
    setattr(sys.modules[parent], leaf, module)
    return module


def __getattr__(name: str) -> Any:
    return getattr(slipstream, name)


def _accepts_inf_steps_per_print() -> bool:
    from slipstream.config import ConfigError, resolve

    try:
        resolve({"train_batch_size": 1, "steps_per_print": float("inf")}, world_size=1)
    except ConfigError as exc:
        return "steps_per_print" not in str(exc)
    return True


def _caller_driven_accumulation(engine_cls: Any) -> None:
    """Accelerate sets the boundary itself and calls backward() with no step() between the micro-batches of a
    window: finish each such micro-batch as step() would have (stage 2 reduces its buckets), without stepping."""
    real_backward = engine_cls.backward

    def backward(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_backward(self, loss, *args, **kwargs)
        if self._boundary_override is False and self.optimizer is not None:
            self.optimizer.micro_step_done(reduce=True)
            self.micro_steps += 1
            self._window_micro_steps += 1
            self._boundary_override = None
            self._scaled_this_micro = False
        return out

    engine_cls.backward = backward
    SHIMMED.append("engine.set_gradient_accumulation_boundary(False) + backward() without step()")


def _install() -> None:
    import torch
    import torch.distributed as dist

    from slipstream.accelerator import get_accelerator
    from slipstream.utils.logging import get_logger

    this = sys.modules[__name__]
    _alias("deepspeed.zero", "slipstream.zero")
    _alias("deepspeed.accelerator", "slipstream.accelerator")
    _alias("deepspeed.ops", "slipstream.ops")
    _alias("deepspeed.ops.adam", "slipstream.ops.adam")

    comm = _module("deepspeed.comm")
    comm.__getattr__ = lambda name: getattr(dist, name)  # get_rank, get_world_size, barrier, all_reduce ...

    utils = _module("deepspeed.utils", logger=get_logger())
    utils.__getattr__ = lambda name: getattr(slipstream.zero, name)  # set_z3_leaf_modules
    _module("deepspeed.utils.groups")

    def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
        if torch.is_tensor(item):
            return item.detach().clone().to(device)
        if isinstance(item, (list, tuple)):
            return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
        if isinstance(item, dict):
            return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
        return item

    _module("deepspeed.checkpoint")
    _module("deepspeed.checkpoint.utils", clone_tensors_for_torch_save=clone_tensors_for_torch_save)

    from slipstream.engine import lr_schedules
    from slipstream.engine.engine import SlipstreamEngine

    _module("deepspeed.runtime")
    valid = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    _module("deepspeed.runtime.lr_schedules", VALID_LR_SCHEDULES=valid, **{n: getattr(lr_schedules, n) for n in valid})
    _module("deepspeed.runtime.engine", DeepSpeedEngine=SlipstreamEngine)

    def zero_wrapper_for_fp_tensor_constructor(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn  # Slipstream's zero.Init does not re-type tensor constructors

    zero = _module("deepspeed.runtime.zero", GatheredParameters=slipstream.zero.GatheredParameters)
    zero.partition_parameters = _module(
        "deepspeed.runtime.zero.partition_parameters",
        zero_wrapper_for_fp_tensor_constructor=zero_wrapper_for_fp_tensor_constructor,
        _orig_torch_arange=torch.arange,
        get_accelerator=get_accelerator,
    )
    this.DeepSpeedEngine = SlipstreamEngine
    if not getattr(SlipstreamEngine, "honours_caller_boundary", False):
        _caller_driven_accumulation(SlipstreamEngine)
    if not _accepts_inf_steps_per_print():
        real = slipstream.initialize

        def initialize(*args: Any, config: Any = None, config_params: Any = None, **kwargs: Any) -> Any:
            cfg = config if config is not None else config_params
            if isinstance(cfg, dict) and cfg.get("steps_per_print") == float("inf"):
                cfg = {**cfg, "steps_per_print": 2**31}  # Accelerate always writes inf ("never")
            return real(*args, config=cfg, **kwargs)

        this.initialize = initialize
        SHIMMED.append("steps_per_print=inf accepted")
    if not hasattr(SlipstreamEngine, "zero_cpu_offload"):
        SlipstreamEngine.zero_cpu_offload = lambda self: self.plan.zero.offload_optimizer is not None  # type: ignore
        SHIMMED.append("DeepSpeedEngine.zero_cpu_offload")


_install()
