"""Offload policies: where master weights and optimizer state live (`NoOffload`, `CPUOffload`)."""

from __future__ import annotations

from slipstream.offload.policy import CPUOffload, NoOffload, OffloadPolicy, host_available_bytes

__all__ = ["CPUOffload", "NoOffload", "OffloadPolicy", "host_available_bytes"]
