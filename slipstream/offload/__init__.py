"""Offload policies, one per offload target: where master weights, optimizer state and stage 3's parameter shards
live (`NoOffload`, `CPUOffload`; `NVMeOffload` in nvme.py; `policy_for` in choose.py picks one for a target)."""

from __future__ import annotations

from slipstream.offload.policy import CPUOffload, NoOffload, OffloadPolicy, host_available_bytes

__all__ = ["CPUOffload", "NoOffload", "OffloadPolicy", "host_available_bytes"]
