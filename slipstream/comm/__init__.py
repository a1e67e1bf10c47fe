"""Process groups and collectives: every collective Slipstream issues goes through `collectives`."""

from __future__ import annotations

from slipstream.comm.collectives import (
    CollectiveError,
    CollectiveTimeout,
    PeerLost,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    reduce_scatter,
)
from slipstream.comm.counting import CollectiveCounter, count_collectives
from slipstream.comm.init import init_distributed, is_initialized

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "PeerLost",
    "CollectiveCounter",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "count_collectives",
    "init_distributed",
    "is_initialized",
    "reduce_scatter",
]
