"""`Option` carries offload target types, and the planner reads each target through its policy class
(offload/choose.py `POLICIES`): what the policy keeps on the host, in files and pinned. The boolean keywords
(`offload_optimizer`, `offload_param`, `nvme`) still build the same options."""

from __future__ import annotations

from typing import ClassVar

import pytest

from slipstream.config.plan import CpuTarget, NoOffloadTarget, NvmeTarget, OffloadTarget
from slipstream.offload import choose
from slipstream.offload.policy import CPUOffload
from slipstream.planner import STANDARD_OPTIONS, Option, OptionEstimate, Settings, estimate_option
from slipstream.planner.shapes import synthetic


class RemoteTarget(OffloadTarget):
    """A target the planner has never heard of: only its policy says what it does."""

    __slots__ = ()
    kind: ClassVar[str] = "remote"


class RemoteOffload(CPUOffload):
    """Steps on the host, keeps its masters and states elsewhere (in "files" for the planner), pins nothing."""

    in_files: ClassVar[bool] = True

    @classmethod
    def pins_configured(cls, pin_memory: bool) -> bool:
        return False


class PageableOffload(CPUOffload):
    """Host memory that is never pinned."""

    @classmethod
    def pins_configured(cls, pin_memory: bool) -> bool:
        return False


def test_boolean_keywords_build_the_target_options() -> None:
    legacy = Option(stage=3, offload_optimizer=True, offload_param=True, nvme=True)
    assert legacy == Option(stage=3, optimizer_target=NvmeTarget, param_target=NvmeTarget)
    assert Option(stage=2, offload_optimizer=True) == Option(stage=2, optimizer_target=CpuTarget)
    assert Option(stage=1).optimizer_target is Option(stage=1).param_target is NoOffloadTarget
    names = [o.name for o in STANDARD_OPTIONS]
    assert names[-2:] == ["zero3+offload_optimizer+offload_param", "zero3+offload_optimizer+offload_param(nvme)"]
    assert (legacy.offload_optimizer, legacy.offload_param, legacy.in_files) == (True, True, True)
    with pytest.raises(ValueError, match="not both"):
        Option(stage=3, optimizer_target=CpuTarget, offload_param=True)
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        Option(stage=2, param_target=CpuTarget)
    with pytest.raises(ValueError, match="nvme needs offload_optimizer"):
        Option(stage=3, nvme=True)
    with pytest.raises(TypeError, match="Option.optimizer_target must be an offload target type"):
        Option(stage=0, optimizer_target=CPUOffload)  # type: ignore[arg-type]


def test_a_new_target_reaches_the_planner_through_its_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(choose.POLICIES, RemoteTarget, RemoteOffload)
    shape = synthetic(params=200_000, hidden=32, layers=2, vocab=None, heads=None)
    settings = Settings(device_is_host=False)

    def row(option: Option) -> OptionEstimate:
        return estimate_option(shape, option, settings=settings, world=2, gpus_per_node=1)

    cpu = row(Option(stage=3, optimizer_target=CpuTarget))
    remote = row(Option(stage=3, optimizer_target=RemoteTarget))
    assert remote.option.name == "zero3+offload_optimizer(remote)"
    assert remote.option.cost_rank > cpu.option.cost_rank
    assert remote.nvme_per_rank == cpu.host["master"] + cpu.host["optimizer_state"] > 0 == cpu.nvme_per_rank
    assert remote.to_dict()["nvme"] is True and remote.to_dict()["offload_optimizer"] is True
    assert cpu.host["pinned_rounding"] > 0

    monkeypatch.setitem(choose.POLICIES, CpuTarget, PageableOffload)
    pageable = row(Option(stage=3, optimizer_target=CpuTarget))
    assert pageable.host["pinned_rounding"] == 0, "a policy that pins nothing has no pinned rounding"
    assert pageable.host["master"] == cpu.host["master"]
