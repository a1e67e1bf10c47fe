"""`GatheredParameters` and `unwrap_model_for_generation`: whole ZeRO-3 parameters on request.

`GatheredParameters(params, modifier_rank=None)` gathers the units of `params` on entry and holds them
(module hooks do not free them inside); on exit, with `modifier_rank`, that rank's values are broadcast
and every rank keeps its new slices (how Transformers initialises and resizes embeddings under stage 3),
then the units are released. Tensors taken inside the block (`state_dict()` values, `p.detach()`, views)
keep their values after it, as in DeepSpeed: see [Note: aliases of gathered values] in stage3/unit.py.
Plain (unsharded) parameters pass through untouched, and every rank must enter with the same parameters,
as with DeepSpeed.
`unwrap_model_for_generation(model)` gathers every unit once and holds it for the whole block, so
`generate()` does not gather the model again for every token (docs/design.md P15).
`unshard_parameters(params)` makes sharded parameters whole, plain parameters for good (a model built
under zero.Init given to a stage 0-2 engine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from slipstream.zero.stage3.sharded_param import ShardedParameter, internal_access, unshard_type


def _managers_and_units(params: object) -> list[tuple[Any, list[Any]]]:
    if params is None:
        return []
    if isinstance(params, nn.Parameter) or not hasattr(params, "__iter__"):
        params = [params]
    grouped: dict[int, tuple[Any, list[Any]]] = {}
    for param in params:
        if not isinstance(param, ShardedParameter):
            continue
        unit = param.ds_record.unit
        units = grouped.setdefault(id(unit.manager), (unit.manager, []))[1]
        if unit not in units:
            units.append(unit)
    return list(grouped.values())


class GatheredParameters:
    """DeepSpeed's `deepspeed.zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)`."""

    def __init__(
        self, params: object, modifier_rank: int | None = None, fwd_module: object = None, enabled: bool = True
    ) -> None:
        self.modifier_rank = modifier_rank
        self.groups = _managers_and_units(params) if enabled else []

    def __enter__(self) -> GatheredParameters:
        for manager, units in self.groups:
            manager.gather_units(units, expose=True)  # tensors taken inside stay valid after the block
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for manager, units in self.groups:
            if self.modifier_rank is not None and exc_type is None:
                manager.broadcast_units(units, src=self.modifier_rank)
            manager.release_units(units)


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Gather the whole model once for the block (an engine or its module); yields the module."""
    module = getattr(model, "module", model)
    from slipstream.zero.stage3.model import zero_model_of

    zero_model = zero_model_of(module)
    if zero_model is None:
        yield module
        return
    units = [u for u in zero_model.units if not u.persistent]
    zero_model.gather_units(units, expose=True)
    try:
        yield module
    finally:
        zero_model.release_units(units)


def unshard_parameters(params: object) -> int:
    """Turn the sharded parameters among `params` back into plain parameters holding their whole values
    (the same objects, so references to them stay valid); returns how many. Collective over each
    parameter's group, like GatheredParameters: every rank passes the same parameters."""
    count = 0
    for manager, units in _managers_and_units(params):
        manager.gather_units(units)
        try:
            with internal_access():
                for unit in units:
                    for param in unit.params:
                        if isinstance(param, ShardedParameter):
                            whole = param.data.detach().clone()
                            unshard_type(param)
                            param.data = whole
                            del param.ds_record
                            count += 1
        finally:
            manager.release_units(units)
    return count


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Tell stage 3 that `module`'s forward uses `parameter` (owned by another module), so its unit is gathered."""
    external = module.__dict__.setdefault("_z3_external_params", [])
    if all(p is not parameter for p in external):
        external.append(parameter)
