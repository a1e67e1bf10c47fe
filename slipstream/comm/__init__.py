"""Process groups and collectives: every collective Slipstream issues goes through `collectives`.

The package's names are DeepSpeed's `deepspeed.comm` functions (dist_api.py: torch.distributed's signatures,
counted and with deadlines). Slipstream's own code calls `slipstream.comm.collectives` (flat tensors,
keyword groups).
"""

from __future__ import annotations

from slipstream.comm.collectives import CollectiveError, CollectiveTimeout, PeerLost
from slipstream.comm.counting import CollectiveCounter, count_collectives
from slipstream.comm.dist_api import *  # noqa: F403 (DeepSpeed's deepspeed.comm functions)
from slipstream.comm.dist_api import __all__ as _DEEPSPEED_NAMES

__all__ = [
    "CollectiveCounter",
    "CollectiveError",
    "CollectiveTimeout",
    "PeerLost",
    "count_collectives",
    *_DEEPSPEED_NAMES,
]
