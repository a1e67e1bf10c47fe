"""`policy_for`: the one place a plan's offload target becomes its runtime policy (the target's type picks the
class; the class builds itself from the target). Optimizer offload and stage 3's parameter offload both go
through it, so a new target adds its plan type, its policy class and one line here."""

from __future__ import annotations

from slipstream.config.plan import CpuTarget, NoOffloadTarget, NvmeTarget, OffloadTarget
from slipstream.offload.nvme import NVMeOffload
from slipstream.offload.policy import CPUOffload, NoOffload, OffloadPolicy

POLICIES: dict[type[OffloadTarget], type[OffloadPolicy]] = {
    NoOffloadTarget: NoOffload,
    CpuTarget: CPUOffload,
    NvmeTarget: NVMeOffload,
}
"""Each offload target's policy class."""


def policy_type(target: OffloadTarget | type[OffloadTarget]) -> type[OffloadPolicy]:
    """The policy class of `target`, a target or a target type (its class-level facts, `on_host`, `in_files`,
    `pins_configured`, need no instance: the planner)."""
    policy = POLICIES.get(target if isinstance(target, type) else type(target))
    if policy is None:
        raise TypeError(
            f"offload target {target!r} has no policy; add its class to POLICIES in slipstream/offload/choose.py"
        )
    return policy


def policy_for(target: OffloadTarget, *, rank: int, section: str = "offload_optimizer") -> OffloadPolicy:
    """The runtime policy of an offload target on `rank`; `section` names the config section ("offload_optimizer"
    or "offload_param") in its errors."""
    return policy_type(target).from_target(target, rank=rank, section=section)
