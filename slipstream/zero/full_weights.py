"""`iter_full_weights`: the whole model's parameters, name by name, gathered a bucket of units at a time.

For weight hand-off (to a generation engine, an exporter, a broadcast to other processes) without the whole
model in memory at once. At stages 0-2 every rank holds every parameter and the values are the parameters
themselves (detached). At stage 3 the units are gathered in buckets of at most `bucket_bytes` of gathered
values (a unit larger than that is a bucket of its own), the bucket's values are taken, and the units are
released before the values are handed out: the values stay valid as long as the caller keeps them (see [Note:
aliases of gathered values] in stage3/unit.py) and their memory goes when the caller drops them. So the extra
memory is one bucket, plus whatever the caller keeps. Collective at stage 3: every rank iterates to the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from slipstream.zero.stage3.model import ZeroModel
from slipstream.zero.stage3.sharded_param import ShardedParameter, internal_access
from slipstream.zero.stage3.unit import Unit

DEFAULT_BUCKET_BYTES = 500_000_000


def unit_buckets(units: list[Unit], bucket_bytes: int) -> list[list[Unit]]:
    """`units` in order, cut into runs of at most `bucket_bytes` gathered bytes (at least one unit each)."""
    buckets: list[list[Unit]] = []
    size = 0
    for unit in units:
        if not buckets or size + unit.full_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(unit)
        size += unit.full_bytes
    return buckets


def iter_full_weights(
    module: nn.Module, zero_model: ZeroModel | None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(qualified name, whole value) of every parameter of `module` (see the module doc)."""
    if bucket_bytes <= 0:
        raise ValueError(f"iter_full_weights(bucket_bytes={bucket_bytes}): give a positive number of bytes")
    named = list(module.named_parameters())
    if zero_model is None:
        for name, param in named:
            yield name, param.detach()
        return
    name_of = {id(p): n for n, p in named}
    for name, param in named:
        if not isinstance(param, ShardedParameter):  # plain parameters beside the sharded ones
            yield name, param.detach()
    units = [u for u in zero_model.units if any(id(p) in name_of for p in u.params)]
    for bucket in unit_buckets(units, bucket_bytes):
        zero_model.gather_units(bucket, expose=True)
        try:
            with internal_access():
                values = [
                    (name_of[id(p)], p.detach().clone() if unit.persistent else p.detach())
                    for unit in bucket
                    for p in unit.params
                    if id(p) in name_of
                ]
        finally:
            zero_model.release_units(bucket)
        yield from values
        del values
