"""`PostTraining`: what a post-training loop (RLHF, weight sync to a generator) asks of the engine between steps,
in one mixin: the states moved to host memory and back (offload_states.py), the whole weights handed out
a bucket at a time (weight_handoff.py)."""

from __future__ import annotations

from slipstream.engine.offload_states import StateOffload
from slipstream.engine.weight_handoff import WeightHandOff


class PostTraining(StateOffload, WeightHandOff):
    """See the module doc; attributes it reads are the engine's."""
