"""Which rank reached which collective: a per-rank sequence number recorded in the process group's store.

[Note: collective sequence numbers]
Every collective Slipstream issues gets the next number of a per-process counter, and before issuing it
the rank records `"<seq> <op>"` under `slipstream/arrive/<rank>` in the default process group's store
(one small store write per collective; ZeRO issues a handful per step). All ranks issue the same
collectives in the same order, so when a collective times out the ranks whose last recorded number is
below ours never arrived: the error names them and what they were last doing.
The store is torch's default store, reached through the one private torch call of this package
(`_get_default_store`); without it the error still names the operation, only not the missing ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch.distributed as dist

_KEY = "slipstream/arrive/{rank}"
_counter = itertools.count(1)


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    seq: int
    op: str


def _store() -> Any:
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def record(op: str) -> int:
    """Take the next sequence number for `op` and record this rank's arrival; returns the number."""
    seq = next(_counter)
    store = _store()
    if store is not None and dist.get_world_size() > 1:
        store.set(_KEY.format(rank=dist.get_rank()), f"{seq} {op}")
    return seq


def last_arrivals(world_size: int) -> dict[int, Arrival | None]:
    """The last collective each rank recorded (None: it recorded none, or the store is unavailable)."""
    store = _store()
    out: dict[int, Arrival | None] = {}
    for rank in range(world_size):
        key = _KEY.format(rank=rank)
        value = None
        if store is not None:
            try:
                if store.check([key]):
                    value = store.get(key).decode()
            except RuntimeError:
                value = None
        if value:
            seq, op = value.split(" ", 1)
            out[rank] = Arrival(int(seq), op)
        else:
            out[rank] = None
    return out
