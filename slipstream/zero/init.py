"""`zero.Init`: shard a model's parameters while it is being built, so no rank ever holds the whole model.

Inside the context every `nn.Module` subclass's `__init__` is wrapped: when the outermost `__init__` of
a module object returns (its own parameters created and initialised, subclasses included), its direct
parameters are cast to `dtype`, made equal to rank 0's values (one broadcast per parameter) and moved
into a *staging unit*: this rank keeps its `ceil(numel / world)` slice of each, and the full values are
freed. So the peak memory of construction is about the largest module plus this rank's shards. In fp32
the initial values are those of the same model built without Init under the same seed (the RNG is consumed
exactly as without it); in bf16/fp16 the constructors below create the tensors in that dtype, as DeepSpeed's
do. The engine later regroups the staging units into its units (model.py), gathering one staging unit at a time. `Init(module=m)` shards an existing model into units at once.

Tensor constructors: inside the context, as in DeepSpeed, `torch.tensor`, `empty`, `zeros`, `ones`, `full`,
`arange`, `eye` and `randn` create their tensors on the accelerator device unless the call names a device,
and floating-point results get Init's dtype (fp32 when the config has neither bf16 nor fp16) unless the call
names a dtype (DeepSpeed casts those too). The wrappers are made on entry by this module's
`zero_wrapper_for_fp_tensor_constructor`, from its `_orig_torch_<name>` functions, both looked up on the module
at that moment: Transformers replaces the wrapper factory, and client code calls `_orig_torch_arange` to
bypass the wrapper (this module is DeepSpeed's `runtime.zero.partition_parameters`). `tensor_overrides`
chooses "dtype" and/or "device" (default both; an empty list turns the wrappers off). torch.Tensor's legacy
constructor (`torch.Tensor(3)`) is not wrapped.
"""

from __future__ import annotations

import difflib
import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.comm import collectives
from slipstream.config import notices
from slipstream.config.plan import Stage3Plan
from slipstream.zero.gathered import GatheredParameters, register_external_parameter
from slipstream.zero.stage3.manager import UnitManager
from slipstream.zero.stage3.pool import BufferPool
from slipstream.zero.stage3.sharded_param import ShardedParameter, ZeroParamStatus
from slipstream.zero.stage3.unit import Unit, UnitMemory, host_or_device_allocator
from slipstream.zero.stage3.units import UnitSpec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# This module is also DeepSpeed's `deepspeed.runtime.zero.partition_parameters` (compat/aliases.py), whose
# names below libraries read and swap while they build a model (Transformers replaces
# `zero_wrapper_for_fp_tensor_constructor` and `_orig_torch_arange`); code that uses them must read them from
# this module when it runs, never bind them at import.
__all__ = [
    "GatheredParameters",
    "Init",
    "MultipleAllGatherHandles",
    "ZeroParamStatus",
    "get_accelerator",
    "is_zero_param",
    "partitioned_param_data_shape",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

partitioned_param_data_shape = [0]
"""The shape of a sharded parameter while it is not gathered (its storage is freed: no elements)."""

# The constructors zero.Init wraps, as DeepSpeed's partition_parameters names them (see the module doc).
TENSOR_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None, target_device: torch.device | None = None
) -> Callable[..., torch.Tensor]:
    """`fn` (a torch tensor constructor) with zero.Init's defaults: on `target_device` unless the call names a
    device; floating-point results in `target_fp_dtype` unless the call names a dtype. None leaves either alone."""

    @functools.wraps(fn)
    def construct(*args: object, **kwargs: object) -> torch.Tensor:
        if target_device is not None and kwargs.get("device") is None:
            kwargs["device"] = target_device
        made = fn(*args, **kwargs)
        wanted = None if kwargs.get("dtype") is not None else target_fp_dtype
        if wanted is not None and made.is_floating_point() and made.dtype != wanted:
            made.data = made.data.to(wanted)  # .data: a leaf made with requires_grad=True stays a leaf
        return made

    return construct


def _override_names(tensor_overrides: Any) -> set[str]:
    """DeepSpeed's `tensor_overrides` (DeepSpeedTensorOverride members or their names) as {"dtype", "device"}."""
    if tensor_overrides is None:
        return {"dtype", "device"}
    names = {str(getattr(item, "name", item)).lower() for item in tensor_overrides}
    unknown = names - {"dtype", "device"}
    if unknown:
        raise ValueError(f"zero.Init(tensor_overrides=...): unknown {sorted(unknown)}; use 'dtype' and/or 'device'")
    return names


class MultipleAllGatherHandles:
    """Several pending gathers awaited as one: `wait()` waits on each handle in turn (DeepSpeed's name).
    `handle_dependency` is passed on by keyword, so handles whose `wait` takes it keyword-only work too."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


def is_zero_param(parameter: object) -> bool:
    """True for a parameter ZeRO-3 shards (it has DeepSpeed's `ds_id`)."""
    return isinstance(parameter, torch.Tensor) and hasattr(parameter, "ds_id")


class StagingUnits(UnitManager):
    """The manager of the units zero.Init creates (one per module, no hooks)."""

    def __init__(self, memory: UnitMemory, *, group: dist.ProcessGroup | None) -> None:
        """`memory.store`: where shards live between uses (offload/nvme.py's NVMeShardStore for remote_device
        nvme)."""
        self.memory, self.group = memory, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.units = []
        self._deferred_tags = []
        self._holds: dict[int, int] = {}

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
                param.data = param.data.to(device=self.memory.device, dtype=target)
                if self.world_size > 1:
                    collectives.broadcast(param.data, src=0, group=self.group)
        spec = UnitSpec(name=f"<init {type(module).__name__} #{len(self.units)}>", module=None, params=tuple(params))
        unit = Unit(
            len(self.units),
            spec,
            manager=self,
            rank=self.rank,
            world_size=self.world_size,
            group=self.group,
            memory=self.memory,
        )
        self.units.append(unit)


def _config_dict(config_dict_or_path: object) -> dict[str, Any]:
    if config_dict_or_path is None:
        return {}
    if isinstance(config_dict_or_path, dict):
        return config_dict_or_path
    from slipstream.config import load_config

    return load_config(config_dict_or_path)  # a path or base64 text, read as initialize() reads it (HJSON)


def _all_subclasses(cls: type) -> list[type]:
    found: list[type] = []
    stack = [cls]
    while stack:
        subclasses: list[type] = stack.pop().__subclasses__()
        for sub in subclasses:
            found.append(sub)
            stack.append(sub)
    return found


# DeepSpeed 0.19's zero.Init keywords beyond the ones Init names, each with its default and what Slipstream does
# instead: given away from the default, each is reported through the config notices (config/notices.py).
_NOT_IMPLEMENTED_KEYWORDS: dict[str, tuple[Any, str]] = {
    "zero_param_parallel_group": (
        None,
        "parameters are sharded over the data-parallel group only (no ZeRO++ secondary partition)",
    ),
    "zero_quantized_weights": (False, "parameters are gathered at their own precision (no ZeRO++ quantized weights)"),
    "zero_quantized_nontrainable_weights": (False, "frozen parameters are kept at their own precision"),
    "param_swapper": (None, "parameters offloaded to NVMe use Slipstream's own store (offload_param.nvme_path)"),
}
_INIT_KEYWORDS = (
    "module", "data_parallel_group", "mem_efficient_linear", "remote_device", "pin_memory", "config_dict_or_path",
    "config", "enabled", "dtype", "mpu", "sequence_data_parallel_group", "tensor_overrides",
    *_NOT_IMPLEMENTED_KEYWORDS,
)  # fmt: skip


def _deepspeed_keywords(given: dict[str, object], data_parallel_group: object) -> Any:
    """The data-parallel group, after checking zero.Init's keywords beyond its named ones: a DeepSpeed keyword
    Slipstream does not act on is reported (when given away from its default), the deprecated
    `sequence_data_parallel_group` stands for `data_parallel_group` as in DeepSpeed, and anything else is a
    TypeError naming the closest keyword."""
    for name in given:
        if name == "sequence_data_parallel_group" or name in _NOT_IMPLEMENTED_KEYWORDS:
            continue
        close = difflib.get_close_matches(name, _INIT_KEYWORDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TypeError(
            f"zero.Init() got an unexpected keyword argument {name!r}; {hint}its keywords are DeepSpeed's: "
            f"{', '.join(_INIT_KEYWORDS)}"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, (default, instead) in _NOT_IMPLEMENTED_KEYWORDS.items():
        if given.get(name, default) is not default:
            message = f"slipstream: zero.Init({name}=...) is accepted but not implemented yet; {instead}"
            notices.notice(f"zero.Init:{name}", message, rank=rank)
    sequence_group = given.get("sequence_data_parallel_group")
    if sequence_group is None:
        return data_parallel_group
    if data_parallel_group is not None:
        raise ValueError(
            "zero.Init(): both data_parallel_group and sequence_data_parallel_group (its deprecated name) were "
            "given; pass only data_parallel_group"
        )
    warnings.warn(
        "zero.Init(sequence_data_parallel_group=...) is deprecated; pass data_parallel_group instead",
        DeprecationWarning,
        stacklevel=4,
    )
    return sequence_group


class Init:
    """DeepSpeed's `deepspeed.zero.Init` (see the module doc), with DeepSpeed 0.19's keywords. `mem_efficient_linear`
    (a memory saving of DeepSpeed's linear layers; results are the same without it) and `mpu` (read by DeepSpeed
    only for the config's batch sizes) are accepted and not used; the ZeRO++ keywords (`zero_quantized_weights`,
    `zero_param_parallel_group`, ...) and `param_swapper` are reported as not implemented when given; an unknown
    keyword is a TypeError naming the closest one."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: object = None,
        config: object = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: object = None,
        tensor_overrides: object = None,
        **deepspeed_keywords: object,
    ) -> None:
        self.enabled = enabled
        if not enabled:
            _deepspeed_keywords(deepspeed_keywords, data_parallel_group)  # unknown keywords are errors anyway
            return
        from slipstream.comm import init_distributed, is_initialized

        if not is_initialized():
            init_distributed()
        data_parallel_group = _deepspeed_keywords(deepspeed_keywords, data_parallel_group)
        from slipstream.config.resolve import resolve_zero_init
        from slipstream.offload.choose import policy_for

        cfg = _config_dict(config_dict_or_path if config_dict_or_path is not None else config)
        stage3, param_dtype = resolve_zero_init(cfg, remote_device=remote_device)
        self._check_plan(stage3)
        if dtype is None:
            dtype = _DTYPES.get(param_dtype)
        self.dtype = dtype
        accelerator = get_accelerator()
        device = accelerator.device(accelerator.current_device())
        overrides = _override_names(tensor_overrides)
        self._constructor_dtype = (dtype or torch.float32) if "dtype" in overrides else None
        self._constructor_device = device if "device" in overrides else None
        self._saved_constructors: list[dict[str, Any]] = []
        offload = policy_for(stage3.offload_param, rank=dist.get_rank(data_parallel_group), section="offload_param")
        memory = UnitMemory(
            device=device,
            shard_device=offload.master_device(device),
            pool=BufferPool(device),
            allocate_shard=host_or_device_allocator(offload.pins_with(pin_memory)),
            store=offload.make_param_store(role="init"),  # files: each module's shard goes to its file as it is built
        )
        self.staging = StagingUnits(memory, group=data_parallel_group)
        self._patched: list[tuple[type, Any]] = []
        if module is not None:
            from slipstream.zero.stage3.model import ZeroModel

            if dtype is not None:
                for param in module.parameters():
                    if not isinstance(param, ShardedParameter) and param.is_floating_point():
                        param.data = param.data.to(dtype)
            ZeroModel(module, stage3, device=device, group=data_parallel_group)

    def _check_plan(self, stage3: Stage3Plan) -> None:
        """Refuse a config this kind of Init cannot build for (MicsInit: one without MiCS); zero.Init takes any."""
        return None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        for cls in [nn.Module, *_all_subclasses(nn.Module)]:
            if "__init__" in cls.__dict__ and cls is not nn.Module:
                original = cls.__dict__["__init__"]
                self._patched.append((cls, original))
                setattr(cls, "__init__", self._wrap(original))  # noqa: B010 (mypy refuses cls.__init__ = ...)
        self._wrap_constructors()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self._patched):
            setattr(cls, "__init__", original)  # noqa: B010
        self._patched.clear()
        if self._saved_constructors:
            for name, previous in self._saved_constructors.pop().items():
                setattr(torch, name, previous)

    def _wrap_constructors(self) -> None:
        """Replace torch's constructors for the context (the previous ones are restored on exit, so nested
        contexts unwind). The factory and the originals are read from this module now, not at import: a
        library may have replaced them (see the module doc)."""
        if self._constructor_dtype is None and self._constructor_device is None:
            return
        module = sys.modules[__name__]
        factory = module.zero_wrapper_for_fp_tensor_constructor
        self._saved_constructors.append({name: getattr(torch, name) for name in TENSOR_CONSTRUCTORS})
        for name in TENSOR_CONSTRUCTORS:
            original = getattr(module, f"_orig_torch_{name}")
            setattr(torch, name, factory(original, self._constructor_dtype, self._constructor_device))

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
