"""A ZeRO-3 model made plain for a generate call while every unit is held gathered.

Once the hybrid engine's `generate` holds every unit gathered for the whole call, nothing the module hooks do
per layer and per token is needed (the units are held, no gradient flows under generate's no_grad), and the
sharded parameters' `__torch_function__` check passes every op through anyway. Both still cost Python time on
every token: in one process a ZeRO-3 generate took 1.15x the plain model's time with them. Inside
`plain_while_held(zero_model)` the coordinator's forward hooks do nothing and every held parameter is of its
plain type (`unshard_type`), so each token runs the plain model's code; on exit the parameters are sharded
parameters again (same objects, same records) and the hooks are back, also when the block raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from slipstream.zero.stage3.model import ZeroModel
from slipstream.zero.stage3.sharded_param import ShardedParameter, ZeroParamStatus, make_sharded, unshard_type


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
