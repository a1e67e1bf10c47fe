"""The `ds_*` attributes and methods of ZeRO-3 parameters that Transformers, PEFT and Accelerate read.

DeepSpeed writes these as plain attributes on every parameter; here they are read-only properties over the
parameter's `ParamRecord` (slipstream/zero/stage3/sharded_param.py), so they are always true:
`ds_id`, `ds_shape` (global shape), `ds_numel`, `ds_status` (a `ZeroParamStatus`), `ds_tensor` (this rank's
slice of the parameter, `ceil(numel / world)` elements), `ds_persist`, `ds_process_group`,
`ds_active_sub_modules`, and the methods `all_gather()`, `all_gather_coalesced()`, `partition()`,
`ds_summary()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _record_field(field: str, cast: Callable[[Any], Any] | None = None) -> property:
    """A read-only property: the parameter's `ds_record.<field>`, passed through `cast` when given."""

    def read(self: DeepSpeedParamAttrs) -> Any:
        value = getattr(self.ds_record, field)
        return value if cast is None else cast(value)

    return property(read, doc=f"`ds_record.{field}` (read-only)")


class DeepSpeedParamAttrs:
    """Mixin of the sharded parameter type; `self.ds_record` is its ParamRecord."""

    ds_record: Any

    ds_id = _record_field("ds_id", int)
    ds_shape = _record_field("shape")
    ds_numel = _record_field("numel", int)
    ds_status = _record_field("status")
    ds_persist = _record_field("persistent", bool)

    @property
    def ds_tensor(self) -> Any:
        record = self.ds_record
        return record.unit.shard[record.shard_offset : record.shard_offset + record.shard_numel]

    @property
    def ds_process_group(self) -> Any:
        return self.ds_record.unit.group

    @property
    def ds_active_sub_modules(self) -> set[int]:
        return set(self.ds_record.unit.active_modules)

    def all_gather(self, param_list: object = None, async_op: bool = False, hierarchy: int = 0) -> None:
        """Gather this parameter's unit (DeepSpeed's `param.all_gather()`); see GatheredParameters."""
        self.ds_record.unit.manager.gather_units([self.ds_record.unit])

    def all_gather_coalesced(self, params: Any, safe_mode: bool = False, quantize: bool = False) -> Any:
        """Gather the units of `params` (DeepSpeed's `param.all_gather_coalesced(params)`); they stay
        gathered until each is released with `partition()`. The gathers finish before this returns, so the
        handle's `wait()` has nothing left to do."""
        by_manager: dict[int, tuple[Any, list[Any]]] = {}
        for param in [params] if isinstance(params, DeepSpeedParamAttrs) else list(params):
            record = getattr(param, "ds_record", None)
            if record is None:
                continue  # a plain parameter is always whole
            units = by_manager.setdefault(id(record.unit.manager), (record.unit.manager, []))[1]
            if record.unit not in units:
                units.append(record.unit)
        for manager, units in by_manager.values():
            manager.gather_units(units)
        return _DoneHandle()

    def partition(self, param_list: object = None, hierarchy: int = 0, has_been_updated: bool = False) -> None:
        """Release this parameter's unit again (DeepSpeed's `param.partition()`)."""
        self.ds_record.unit.manager.release_units([self.ds_record.unit])

    def ds_summary(self) -> dict[str, Any]:
        return {
            "id": self.ds_id,
            "status": self.ds_status.name,
            "numel": self.ds_numel,
            "ds_numel": self.ds_numel,
            "shape": tuple(self.ds_shape),
            "ds_shape": tuple(self.ds_shape),
            "requires_grad": bool(getattr(self, "requires_grad", False)),
            "persist": self.ds_persist,
            "active_sub_modules": self.ds_active_sub_modules,
        }


class _DoneHandle:
    """The handle of a gather that already finished."""

    def wait(self, handle_dependency: bool = True) -> None:
        return None
