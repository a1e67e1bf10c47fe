"""`zero.Init`: shard a model's parameters while it is being built, so no rank ever holds the whole model.

Inside the context every `nn.Module` subclass's `__init__` is wrapped: when the outermost `__init__` of
a module object returns (its own parameters created and initialised, subclasses included), its direct
parameters are cast to `dtype`, made equal to rank 0's values (one broadcast per parameter) and moved
into a *staging unit*: this rank keeps its `ceil(numel / world)` slice of each, and the full values are
freed. So the peak memory of construction is about the largest module plus this rank's shards. The
initial values are those of the same model built without Init under the same seed (the RNG is consumed
exactly as without it). The engine later regroups the staging units into its units (model.py), gathering
one staging unit at a time. `Init(module=m)` shards an existing model into units at once.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.comm import collectives
from slipstream.zero.gathered import GatheredParameters, register_external_parameter
from slipstream.zero.stage3.manager import UnitManager
from slipstream.zero.stage3.pool import BufferPool
from slipstream.zero.stage3.sharded_param import ShardedParameter, ZeroParamStatus
from slipstream.zero.stage3.unit import Unit, host_or_device_allocator
from slipstream.zero.stage3.units import UnitSpec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# This module is also DeepSpeed's `deepspeed.runtime.zero.partition_parameters` (compat/aliases.py), whose
# names below libraries read and swap while they build a model (Transformers replaces
# `zero_wrapper_for_fp_tensor_constructor` and `_orig_torch_arange`); code that uses them must read them from
# this module when it runs, never bind them at import.
__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "get_accelerator",
    "is_zero_param",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: torch.dtype) -> Any:
    """`fn` (a tensor constructor) made to create on the accelerator's current device when no device is given,
    and to cast floating-point results to `target_fp_dtype` (DeepSpeed's wrapper of the same name)."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            accelerator = get_accelerator()
            kwargs["device"] = accelerator.device(accelerator.current_device())
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped_fn


def is_zero_param(parameter: Any) -> bool:
    """True for a parameter ZeRO-3 shards (it has DeepSpeed's `ds_id`)."""
    return isinstance(parameter, torch.Tensor) and hasattr(parameter, "ds_id")


class StagingUnits(UnitManager):
    """The manager of the units zero.Init creates (one per module, no hooks)."""

    def __init__(
        self, *, device: torch.device, shard_device: torch.device, pin_memory: bool, group: dist.ProcessGroup | None
    ) -> None:
        self.device, self.shard_device, self.group = device, shard_device, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.pool = BufferPool(device)
        self.units = []
        self._deferred_tags = []
        self._holds: dict[int, int] = {}
        self._allocate = host_or_device_allocator(pin_memory)

    def _hold(self, unit: Unit, delta: int) -> int:
        self._holds[unit.uid] = max(0, self._holds.get(unit.uid, 0) + delta)
        return self._holds[unit.uid]

    def shard_module(self, module: nn.Module, dtype: torch.dtype | None) -> None:
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if not isinstance(p, ShardedParameter)]
        if not params:
            return
        with torch.no_grad():
            for _, param in params:
                target = dtype if dtype is not None and param.is_floating_point() else param.dtype
                param.data = param.data.to(device=self.device, dtype=target)
                if self.world_size > 1:
                    collectives.broadcast(param.data, src=0, group=self.group)
        spec = UnitSpec(name=f"<init {type(module).__name__} #{len(self.units)}>", module=None, params=tuple(params))
        self.units.append(
            Unit(
                len(self.units),
                spec,
                manager=self,
                rank=self.rank,
                world_size=self.world_size,
                group=self.group,
                device=self.device,
                shard_device=self.shard_device,
                pool=self.pool,
                allocate_shard=self._allocate,
            )
        )


def _config_dict(config_dict_or_path: Any) -> dict[str, Any]:
    if config_dict_or_path is None:
        return {}
    if isinstance(config_dict_or_path, dict):
        return config_dict_or_path
    return json.loads(Path(config_dict_or_path).read_text())


def _all_subclasses(cls: type) -> list[type]:
    found: list[type] = []
    stack = [cls]
    while stack:
        subclasses: list[type] = stack.pop().__subclasses__()
        for sub in subclasses:
            found.append(sub)
            stack.append(sub)
    return found


class Init:
    """DeepSpeed's `deepspeed.zero.Init` (see the module doc). Arguments DeepSpeed has but Slipstream does not
    use (`mem_efficient_linear`, `mpu`, quantization, ...) are accepted and ignored."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **ignored: Any,
    ) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from slipstream.accelerator import get_accelerator
        from slipstream.comm import init_distributed, is_initialized

        if not is_initialized():
            init_distributed()
        from slipstream.config.plan import CpuTarget, NvmeTarget
        from slipstream.config.resolve import resolve_zero_init

        cfg = _config_dict(config_dict_or_path if config_dict_or_path is not None else config)
        stage3, param_dtype = resolve_zero_init(cfg, remote_device=remote_device)
        if isinstance(stage3.offload_param, NvmeTarget):
            raise NotImplementedError(
                "zero.Init(remote_device='nvme') is not available yet; use 'cpu' or leave it unset"
            )
        if dtype is None:
            dtype = _DTYPES.get(param_dtype)
        self.dtype = dtype
        accelerator = get_accelerator()
        device = accelerator.device(accelerator.current_device())
        on_host = stage3.offload_param.on_host
        pinned = on_host and isinstance(stage3.offload_param, CpuTarget) and stage3.offload_param.pin_memory
        self.staging = StagingUnits(
            device=device,
            shard_device=torch.device("cpu") if on_host else device,
            pin_memory=pin_memory or pinned,
            group=data_parallel_group,
        )
        self._patched: list[tuple[type, Any]] = []
        if module is not None:
            from slipstream.zero.stage3.model import ZeroModel

            if dtype is not None:
                for param in module.parameters():
                    if not isinstance(param, ShardedParameter) and param.is_floating_point():
                        param.data = param.data.to(dtype)
            ZeroModel(module, stage3, device=device, group=data_parallel_group)

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        for cls in [nn.Module, *_all_subclasses(nn.Module)]:
            if "__init__" in cls.__dict__ and cls is not nn.Module:
                original = cls.__dict__["__init__"]
                self._patched.append((cls, original))
                setattr(cls, "__init__", self._wrap(original))  # noqa: B010 (mypy refuses cls.__init__ = ...)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self._patched):
            setattr(cls, "__init__", original)  # noqa: B010
        self._patched.clear()

    def _wrap(self, original: Any) -> Any:
        staging, dtype = self.staging, self.dtype

        @functools.wraps(original)
        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = module.__dict__.get("_slipstream_init_depth", 0)
            object.__setattr__(module, "_slipstream_init_depth", depth + 1)
            try:
                original(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_slipstream_init_depth", depth)
            if depth == 0:
                module.__dict__.pop("_slipstream_init_depth", None)
                staging.shard_module(module, dtype)

        return __init__
