"""One offload policy per target (offload/choose.py `policy_for`), read alike by the ZeRO optimizers, stage 3's
parameter shards, zero.Init and the planner: which class each target gets, what it decides (pinning, where
shards live, the parameter store), and that building a policy writes nothing to disk."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from slipstream.config import resolve
from slipstream.config.plan import CpuTarget, NoOffloadTarget, NvmeTarget, OffloadTarget
from slipstream.config.zero_plans import default_aio_plan
from slipstream.offload.choose import policy_for, policy_type
from slipstream.offload.nvme import NVMeOffload, NVMeShardStore
from slipstream.offload.policy import CPUOffload, NoOffload


def test_each_target_gets_its_policy_and_its_decisions(tmp_path: Path) -> None:
    cuda = torch.device("cuda", 0)
    none = policy_for(NoOffloadTarget(), rank=0)
    assert type(none) is NoOffload and none.master_device(cuda) == cuda
    assert not (none.on_host or none.host_resident or none.pins or none.in_files)
    assert none.make_param_store() is None and none.pins_with(True)
    for pin in (True, False):
        cpu = policy_for(CpuTarget(pin_memory=pin), rank=0)
        assert type(cpu) is CPUOffload and cpu.master_device(cuda) == torch.device("cpu")
        assert cpu.on_host and cpu.host_resident and cpu.pins is pin and not cpu.in_files
        assert cpu.make_param_store() is None and cpu.pins_with(True)
        nvme_target = NvmeTarget(pin_memory=pin, path=str(tmp_path), aio=default_aio_plan())
        nvme = policy_for(nvme_target, rank=1, section="offload_param")
        assert type(nvme) is NVMeOffload and nvme.master_device(cuda) == torch.device("cpu")
        assert nvme.on_host and nvme.in_files and not nvme.host_resident
        assert nvme.pins is False, "NVMe's swappable host buffers are resized; they are never pinned"
        assert nvme.pins_with(True) is False, "not even when zero.Init's pin_memory asks"
        assert list(tmp_path.iterdir()) == [], "building the policy (the planner, zero.Init) makes no directory"
        store = nvme.make_param_store(role="init")
        assert isinstance(store, NVMeShardStore) and not store.in_memory
        assert store.directory.parent == tmp_path and re.search(r"-rank1-init\d+$", store.directory.name)
        store.directory.rmdir()


def test_nvme_policy_names_its_section_and_unknown_targets_are_refused(tmp_path: Path) -> None:
    missing = NvmeTarget(pin_memory=False, path=str(tmp_path / "missing"), aio=default_aio_plan())
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_param\.nvme_path=.*not a writable"):
        policy_for(missing, rank=0, section="offload_param")
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.nvme_path=.*not a writable"):
        policy_for(missing, rank=0)

    class RemoteTarget(OffloadTarget):
        __slots__ = ()

    with pytest.raises(TypeError, match="RemoteTarget.*has no policy; add its class to POLICIES"):
        policy_for(RemoteTarget(), rank=0)


@pytest.mark.parametrize(
    ("offload", "in_files"), [(None, False), ({"device": "cpu"}, False), ({"device": "nvme", "nvme_path": "/nv"}, True)]
)
def test_planner_counts_what_the_policy_says(offload: dict | None, in_files: bool) -> None:
    from slipstream.planner.estimate import settings_from_plan

    zero: dict = {"stage": 3}
    if offload is not None:
        zero["offload_optimizer"] = offload
    plan = resolve({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=2)
    _, option = settings_from_plan(plan)
    assert option.in_files is in_files is policy_type(plan.zero.offload_optimizer).in_files
    assert option.optimizer_target is type(plan.zero.offload_optimizer)
    assert option.offload_optimizer is (offload is not None)


def test_every_target_is_a_schema_device_decoded_by_kind_and_has_a_policy() -> None:
    from typing import get_args

    from slipstream.config.plan import OFFLOAD_TARGETS
    from slipstream.config.schema.zero import OffloadDevice, OffloadParamConfig
    from slipstream.config.zero_plans import offload_target
    from slipstream.offload.choose import POLICIES

    assert sorted(target.kind for target in OFFLOAD_TARGETS) == sorted(get_args(OffloadDevice))
    assert set(POLICIES) == set(OFFLOAD_TARGETS), "every offload target needs its policy class in POLICIES"
    for target in OFFLOAD_TARGETS:
        section = OffloadParamConfig(device=target.kind, nvme_path="/nv", pin_memory=False)
        decoded = offload_target(section, default_aio_plan())
        assert type(decoded) is target and decoded.kind == target.kind
    assert offload_target(None, default_aio_plan()) == NoOffloadTarget()
