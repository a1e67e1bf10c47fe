"""The sharded parameter: an `nn.Parameter` that keeps its global shape but refuses data access while sharded.

Model code and libraries read a sharded parameter's `.shape`, `numel()`, `dtype`, `device` and
`requires_grad` as usual (docs/design.md P13). While its unit is not gathered, the operations that derive a
new tensor from it without computing on its values (`detach()`, `.data`, `clone()`, a `.to()`/`.cpu()`/
`.float()` that converts) give DeepSpeed's stand-in: a 0-element tensor of the result's dtype and device,
as DeepSpeed's sharded `param.data` is (see [Note: stand-ins of sharded parameters]). Any other operation that
would read or write its values raises `ShardedParameterError`, which names the parameter and says to use
`slipstream.zero.GatheredParameters`, instead of computing on freed storage. The check is a
`__torch_function__` override; while the unit is gathered every op passes straight through (results are
plain tensors).

[Note: stand-ins of sharded parameters] Outside a gather a parameter's storage holds 0 bytes under its global
shape, so a plain tensor that aliased it would crash the process when read (SIGSEGV, not an exception). Client
code written for DeepSpeed takes `p.detach()` (every `state_dict()` value), `p.data`, `p.clone()` and
conversions of sharded parameters, and only looks at their keys, dtype or device, or hashes or saves them,
expecting DeepSpeed's empty tensors. Those ops therefore return a new 0-element tensor, sharing nothing with
the parameter: it never gathers later (DeepSpeed's does not either), reading it reads nothing, and
`p.data = stand_in` (DeepSpeed's `p.data = p.data.to(same dtype and device)`) changes nothing. The parameter
itself keeps its global shape and `numel()`; its values are reached through GatheredParameters.

Per-parameter state lives in a typed `ParamRecord` (docs/design.md D9); the `ds_*` attributes come from
`slipstream.zero.stage3.param_attrs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from slipstream.utils.torch_shim import no_subclass_dispatch
from slipstream.zero.slices import OwnedSlice
from slipstream.zero.stage3.param_attrs import DeepSpeedParamAttrs


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's values: AVAILABLE (gathered), NOT_AVAILABLE (sharded), INFLIGHT (being gathered)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class ShardedParameterError(RuntimeError):
    """A sharded (ZeRO-3) parameter's values were used while they were not gathered."""


_ids = itertools.count()


@dataclasses.dataclass(eq=False, slots=True)
class ParamRecord:
    """What stage 3 knows about one parameter (the `ds_*` attributes read from here)."""

    name: str
    shape: torch.Size
    numel: int
    unit: Any
    """The `Unit` that owns this parameter (unit.py)."""
    index: int
    """Position in the unit's parameter list."""
    shard_offset: int
    shard_numel: int
    """ceil(numel / world): this rank's slice, padded at the end of the parameter."""
    full_offset: int
    persistent: bool
    ds_id: int = dataclasses.field(default_factory=lambda: next(_ids))

    @property
    def status(self) -> ZeroParamStatus:
        return self.unit.status

    def owned_values(self, name: str) -> OwnedSlice | None:
        """This rank's part of the parameter, [rank * shard_numel, (rank + 1) * shard_numel) clipped to numel,
        as a view of its shard; None when the rank's slice is padding only."""
        rank = self.unit.rank
        lo, hi = min(self.numel, rank * self.shard_numel), min(self.numel, (rank + 1) * self.shard_numel)
        if hi <= lo:
            return None
        value = self.unit.shard[self.shard_offset : self.shard_offset + hi - lo]
        return OwnedSlice(name=name, shape=tuple(self.shape), lo=lo, hi=hi, value=value)


_INTERNAL = [0]


@contextlib.contextmanager
def internal_access() -> Iterator[None]:
    """Slipstream's own code touching sharded parameters (gather, reduce, checkpoint): no checks."""
    _INTERNAL[0] += 1
    try:
        yield
    finally:
        _INTERNAL[0] -= 1


_PROPERTIES = (
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "is_leaf",
    "grad",
    "grad_fn",
    "ndim",
    "layout",
    "is_cuda",
    "is_meta",
    "is_sparse",
    "is_quantized",
    "is_mps",
    "is_cpu",
    "is_nested",
    "names",
    "_is_view",
    "itemsize",
    "output_nr",
    "_version",
    "_base",
    "is_mkldnn",
    "is_xpu",
)
_METHODS = (
    "size",
    "dim",
    "numel",
    "nelement",
    "ndimension",
    "element_size",
    "is_floating_point",
    "is_complex",
    "requires_grad_",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "__len__",
    "type",
    "__hash__",
    "get_device",
    "is_signed",
    "is_inference",
    "_is_zerotensor",
    "is_contiguous",
)


def _metadata_functions() -> set[Any]:
    allowed: set[Any] = set()
    for name in _PROPERTIES:
        descriptor = getattr(torch.Tensor, name, None)
        if descriptor is None:
            continue
        for accessor in ("__get__", "__set__"):
            if hasattr(descriptor, accessor):
                allowed.add(getattr(descriptor, accessor))
    allowed.update(getattr(torch.Tensor, name) for name in _METHODS if hasattr(torch.Tensor, name))
    allowed.update({torch.is_floating_point, torch.numel, torch.is_complex, torch._has_compatible_shallow_copy_type})
    return allowed


_METADATA = _metadata_functions()
_DATA_SET = torch.Tensor.data.__set__  # type: ignore[attr-defined]


def _is_noop_move(func: Any, args: Any, kwargs: Any) -> bool:
    """`p.to(...)` / `p.cpu()` that changes neither device nor dtype nor makes a copy returns `p` itself
    without reading a value (as for any tensor), and `p.data = p` stores nothing: both are allowed while
    sharded, so `model.cpu()` / `model.to(device)` on a model built under zero.Init works (docs/zero3.md)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    tensor = args[0]
    if func == _DATA_SET:
        return len(args) == 2 and args[1] is tensor
    if func is torch.Tensor.cpu:
        return tensor.device.type == "cpu" and not kwargs.get("memory_format")
    if func is torch.Tensor.to:
        flags = [a for a in args[1:] if isinstance(a, bool)]  # (non_blocking, copy) when given by position
        if kwargs.get("copy") or (len(flags) >= 2 and flags[1]):
            return False
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (TypeError, RuntimeError):
            return False
        same_device = (
            device is None
            or torch.device(device) == tensor.device
            or (torch.device(device).index is None and torch.device(device).type == tensor.device.type)
        )
        return same_device and (dtype is None or dtype == tensor.dtype) and memory_format is None
    return False


def _is_own_stand_in(tensor: torch.Tensor, value: object) -> bool:
    """`value` is a stand-in (see [Note: stand-ins of sharded parameters]) of `tensor`'s dtype and device."""
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, ShardedParameter)
        and value.numel() == 0
        and value.dtype == tensor.dtype
        and value.device == tensor.device
    )


_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]
_ALIASES = {torch.Tensor.detach, torch.detach, torch.Tensor.clone, torch.clone, _DATA_GET}
_CASTS = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.double: torch.float64,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
}


def _stand_in(func: Any, args: Any, kwargs: Any, param: ShardedParameter) -> torch.Tensor | None:
    """What `func(param, ...)` derives from a parameter that is not gathered, or None where it needs values.
    See [Note: stand-ins of sharded parameters]."""
    if not args or args[0] is not param:
        return None
    dtype, device = param.dtype, param.device
    if func in _CASTS:
        dtype = _CASTS[func]
    elif func is torch.Tensor.cpu:
        device = torch.device("cpu")
    elif func is torch.Tensor.to:
        try:
            positional = args[1:3] if len(args) > 3 else args[1:]  # (..., non_blocking, copy): copy not parsed
            moved = {k: v for k, v in kwargs.items() if k != "copy"}
            to_device, to_dtype, _, _ = torch._C._nn._parse_to(*positional, **moved)
        except (TypeError, RuntimeError):
            return None
        device = torch.device(to_device) if to_device is not None else device
        dtype = to_dtype if to_dtype is not None else dtype
    elif func not in _ALIASES:
        return None
    return torch.empty(0, dtype=dtype, device=device)


def _blocked(value: object) -> ShardedParameter | None:
    if isinstance(value, ShardedParameter) and value.ds_record.unit.status is not ZeroParamStatus.AVAILABLE:
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, ShardedParameter) and item.ds_record.unit.status is not ZeroParamStatus.AVAILABLE:
                return item
    return None


class ShardedParameter(DeepSpeedParamAttrs, nn.Parameter):
    """An `nn.Parameter` whose values live sharded across ranks (see the module doc)."""

    ds_record: ParamRecord

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _INTERNAL[0] and func not in _METADATA and not _is_noop_move(func, args, kwargs):
            for value in itertools.chain(args, kwargs.values()):
                param = _blocked(value)
                if param is None:
                    continue
                # inside a unit's forward: gather the owner now and from then on with that unit (DeepSpeed fetches
                # another module's parameter the same way); elsewhere, or if it did not help, it is an error
                coordinator = getattr(param.ds_record.unit.manager, "coordinator", None)
                borrowed = coordinator is not None and coordinator.borrow_on_use(
                    param.ds_record.unit, param.ds_record.name
                )
                if not borrowed or _blocked(value) is not None:
                    if func == _DATA_SET and len(args) == 2 and _is_own_stand_in(param, args[1]):
                        return None  # `p.data = p.data.to(...)`, nothing converted: see [Note: stand-ins ...]
                    stand_in = _stand_in(func, args, kwargs, param)
                    if stand_in is None:
                        raise ShardedParameterError(_access_message(param, func))
                    return stand_in
        with no_subclass_dispatch():
            return func(*args, **kwargs)

    def __repr__(self, *args: object, **kwargs: object) -> str:  # type: ignore[override]
        record = self.ds_record
        if record.unit.status is ZeroParamStatus.AVAILABLE:
            with internal_access():
                return f"ShardedParameter({record.name}, gathered):\n{torch.Tensor.__repr__(self.detach())}"
        return (
            f"ShardedParameter({record.name}, shape={tuple(record.shape)}, dtype={self.dtype}, sharded over "
            f"{record.unit.world_size} ranks)"
        )

    def __deepcopy__(self, memo: object) -> Any:
        raise ShardedParameterError(_access_message(self, "copy.deepcopy"))

    def __reduce_ex__(self, protocol: object) -> Any:
        raise ShardedParameterError(_access_message(self, "pickling"))


def _access_message(param: ShardedParameter, func: object) -> str:
    name = getattr(func, "__name__", str(func))
    record = param.ds_record
    return (
        f"parameter '{record.name}' (shape {tuple(record.shape)}) is sharded (ZeRO-3) and its values are not "
        f"gathered on this rank, so '{name}' cannot use them. Wrap the code in "
        f"`with slipstream.zero.GatheredParameters([param]):` (add modifier_rank=0 to change the values), or "
        "run it inside the model's forward"
    )


_SUBCLASSES: dict[type, type] = {nn.Parameter: ShardedParameter}


def make_sharded(param: nn.Parameter, record: ParamRecord) -> ShardedParameter:
    """Turn `param` (in place: same object, so optimizers and tied modules keep working) into a sharded one."""
    cls = type(param)
    if isinstance(param, ShardedParameter):  # re-sharded into a new unit (zero.Init staging -> engine units)
        param.ds_record = record
        return param
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedParameter, cls), {})
    param.__class__ = _SUBCLASSES[cls]
    sharded: Any = param
    sharded.ds_record = record
    return sharded


def unshard_type(param: ShardedParameter) -> None:
    """Give a parameter its plain type back (engine.destroy)."""
    for original, sharded in _SUBCLASSES.items():
        if type(param) is sharded:
            param.__class__ = original
            return
