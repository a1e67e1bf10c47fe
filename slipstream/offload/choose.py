"""`policy_for`: the runtime offload policy of a plan's offload target (its type picks the class)."""

from __future__ import annotations

from slipstream.config.plan import CpuTarget, NvmeTarget, OffloadTarget
from slipstream.offload.nvme import NVMeOffload
from slipstream.offload.policy import CPUOffload, NoOffload, OffloadPolicy


def policy_for(target: OffloadTarget, *, rank: int) -> OffloadPolicy:
    """The runtime policy of an optimizer offload target (the plan's type picks the class)."""
    if isinstance(target, NvmeTarget):
        return NVMeOffload(pin_memory=False, nvme_path=target.path, rank=rank, aio=target.aio)
    if isinstance(target, CpuTarget):
        return CPUOffload(pin_memory=target.pin_memory)
    return NoOffload()
