"""A ZeRO-3 unit's gradient reduce-scatter cut by reduce dtype (torch_autocast's safe modules).

Under `torch_autocast` the parameters of the safe modules (precision/reduce_dtypes.py) have their gradients
reduced in the autocast dtype and the others in the ZeRO reduce dtype. A unit (a transformer block) usually
holds both, so its reduce-scatter becomes one per dtype: each dtype's parameters are packed side by side into
rows of their own (the part in the ring's dtype into the front of the ring's staging slot, the others into
buffers of the unit's pool), each part is reduce-scattered in its dtype, and once all have completed each part's
columns are copied (cast) into the unit's receive buffer, where the optimizer adds them into the fp32 gradient
shards as for any unit. A unit whose trainable parameters all travel in the ring's dtype takes the usual path.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from slipstream.precision.reduce_dtypes import reduce_dtype_of
from slipstream.zero.optimizer import DTYPES
from slipstream.zero.stage3.pool import BufferPool
from slipstream.zero.stage3.units import ShardLayout


class PackingUnit(Protocol):
    """What the split needs of a unit (zero/stage3/unit.py `Unit`; its `reduce_gradients` packs and launches)."""

    params: list[nn.Parameter]
    layout: ShardLayout
    world_size: int
    pool: BufferPool

    @property
    def reduce_gradients(self) -> Callable[..., Any]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """The trainable parameters `indices` of a unit reduced in `dtype`: their columns (`widths`) and their offsets
    in the unit's receive buffer (`targets`)."""

    dtype: torch.dtype
    indices: list[int]
    widths: list[int]
    targets: list[int]

    def offsets(self) -> list[int]:
        """Where each parameter's columns start in the part's own rows."""
        return list(itertools.accumulate(self.widths, initial=0))[:-1]


def any_reduce_dtype(params: Sequence[nn.Parameter]) -> bool:
    """Whether any of `params` has a reduce dtype of its own (torch_autocast marks them before ZeRO places the
    model): a unit without one never splits its reduce-scatter, so it never asks `dtype_parts`."""
    return any(reduce_dtype_of(p) is not None for p in params)


def dtype_parts(
    unit: PackingUnit, trainable: Sequence[int], shard_offsets: Sequence[int], default: torch.dtype
) -> list[Part] | None:
    """`trainable` grouped by reduce dtype (`default` for parameters without one), or None when all are `default`."""
    by_dtype: dict[torch.dtype, Part] = {}
    for index, target in zip(trainable, shard_offsets):
        name = reduce_dtype_of(unit.params[index])
        dtype = default if name is None else DTYPES[name]
        part = by_dtype.setdefault(dtype, Part(dtype, [], [], []))
        part.indices.append(index)
        part.widths.append(unit.layout.shard_numels[index])
        part.targets.append(target)
    if set(by_dtype) <= {default}:
        return None
    return list(by_dtype.values())


class SplitWork:
    """The parts' collectives as one: `wait()` waits for each, copies its columns into `receive` and gives its
    buffers back to the pool."""

    def __init__(self, receive: torch.Tensor, pool: BufferPool) -> None:
        self.receive, self.pool = receive, pool
        self.launched: list[tuple[Any, torch.Tensor, Part, list[torch.Tensor]]] = []

    def wait(self) -> None:
        for work, received, part, pooled in self.launched:
            if work is not None:
                work.wait()
            for start, width, target in zip(part.offsets(), part.widths, part.targets):
                self.receive[target : target + width].copy_(received[start : start + width])
            for buffer in pooled:
                self.pool.give(buffer)
        self.launched.clear()


def launch_parts(
    unit: PackingUnit,
    parts: list[Part],
    grads: dict[int, torch.Tensor],
    staging: torch.Tensor,
    receive: torch.Tensor,
    *,
    scale: float,
) -> SplitWork:
    """Pack and launch one reduce-scatter per part (see the module docstring); the returned work completes them."""
    split = SplitWork(receive, unit.pool)
    for part in parts:
        total = sum(part.widths)
        received = unit.pool.take(total, part.dtype)
        pooled = [received]
        if part.dtype == staging.dtype:  # the front of the ring's own slot: free until this work completes
            rows = staging[: total * unit.world_size]
        else:
            rows = unit.pool.take(total * unit.world_size, part.dtype)
            pooled.append(rows)
        work = unit.reduce_gradients(grads, part.indices, rows, received, part.offsets(), scale=scale)
        split.launched.append((work, received, part, pooled))
    return split
