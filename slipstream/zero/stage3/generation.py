"""A ZeRO-3 model made plain for a generate call while every unit is held gathered.

Once the hybrid engine's `generate` holds every unit gathered for the whole call, nothing the module hooks do
per layer and per token is needed (the units are held, no gradient flows under generate's no_grad), and the
sharded parameters' `__torch_function__` check passes every op through anyway. Both still cost Python time on
every token: in one process a ZeRO-3 generate took 1.15x the plain model's time with them. Inside
`plain_while_held(zero_model)` the coordinator's forward hooks do nothing and every held parameter is of its
plain type (`unshard_type`), so each token runs the plain model's code; on exit the parameters are sharded
parameters again (same objects, same records) and the hooks are back, also when the block raised.

`ShardedWeights` hands the whole values to the tensor-parallel inference copy of the hybrid engine
(`inference_tp_size` > 1), a chunk of units at a time (`tp_gather_partition_size`), never the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from slipstream.zero.stage3.model import ZeroModel
from slipstream.zero.stage3.sharded_param import (
    ShardedParameter,
    ZeroParamStatus,
    internal_access,
    make_sharded,
    unshard_type,
)


def _held_parameters(zero_model: ZeroModel) -> list[ShardedParameter]:
    held: dict[int, ShardedParameter] = {}
    for unit in zero_model.units:
        if unit.status is not ZeroParamStatus.AVAILABLE:
            raise RuntimeError(
                f"plain_while_held: unit {unit.uid} is {unit.status.name}; gather every unit first "
                "(unwrap_model_for_generation) so that no parameter is used while sharded"
            )
        held.update((id(p), p) for p in unit.params if isinstance(p, ShardedParameter))
    return list(held.values())


@contextlib.contextmanager
def plain_while_held(zero_model: ZeroModel) -> Iterator[None]:
    """The model's hooks paused and its parameters plain for the block (see the module doc). Every unit must be
    gathered and held for the whole block (unwrap_model_for_generation), and no backward may run inside it."""
    params = _held_parameters(zero_model)
    coordinator = zero_model.coordinator
    coordinator.paused = True
    for param in params:
        unshard_type(param)
    try:
        yield
    finally:
        for param in params:
            make_sharded(param, param.ds_record)
        coordinator.paused = False


class ShardedWeights:
    """The whole values of a ZeRO-3 model's parameters for the hybrid engine's tensor-parallel inference copy
    (inference/hybrid_tp.py): `chunks` gathers `units_per_chunk` units at a time, in the model's unit order, and
    holds them while the caller copies out of the parameters it yields (collective: every rank of the model's
    group iterates to the end with the same parameters). Parameters that are not sharded come first, alone."""

    def __init__(self, zero_model: ZeroModel) -> None:
        self.zero_model = zero_model

    def shape(self, param: nn.Parameter) -> torch.Size:
        """The whole shape of `param` (a sharded parameter's own shape is its stand-in's)."""
        return param.ds_record.shape if isinstance(param, ShardedParameter) else param.shape

    def chunks(self, params: list[nn.Parameter], units_per_chunk: int) -> Iterator[list[nn.Parameter]]:
        by_unit: dict[int, list[nn.Parameter]] = {}
        plain = []
        for param in params:
            if isinstance(param, ShardedParameter):
                by_unit.setdefault(id(param.ds_record.unit), []).append(param)
            else:
                plain.append(param)
        if plain:
            yield plain
        units = [unit for unit in self.zero_model.units if id(unit) in by_unit]
        for first in range(0, len(units), units_per_chunk):
            chunk = units[first : first + units_per_chunk]
            self.zero_model.gather_units(chunk)
            try:
                with internal_access():
                    yield [param for unit in chunk for param in by_unit[id(unit)]]
            finally:
                self.zero_model.release_units(chunk)
