"""Data efficiency: the schedules that shape what the model sees per step (the legacy seqlen curriculum and
progressive layer drop, handed to the forward as keyword arguments)."""

from __future__ import annotations

from slipstream.data.curriculum import CurriculumScheduler
from slipstream.data.forward_kwargs import ForwardSchedules
from slipstream.data.layer_drop import ProgressiveLayerDrop

__all__ = ["CurriculumScheduler", "ForwardSchedules", "ProgressiveLayerDrop"]
