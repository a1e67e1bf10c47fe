"""`launch_config` builds torch's `LaunchConfig` from the fields this torch has: torch 2.11's has no
`shutdown_timeout` (found on a GPU machine with torch 2.11, where every launch failed with a TypeError)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed.launcher.api as launcher_api

from slipstream.launcher import local
from slipstream.launcher.plan import LaunchPlan, Program, Rendezvous


def _plan(elastic: bool) -> LaunchPlan:
    return LaunchPlan(world={"localhost": [0, 1]}, rendezvous=Rendezvous(master_addr="127.0.0.1", elastic=elastic),
                      program=Program(command=["train.py"]))


@pytest.mark.parametrize("elastic", [False, True])
def test_fields_this_torch_lacks_are_left_out(monkeypatch: pytest.MonkeyPatch, elastic: bool) -> None:
    fields = [(f.name, f.type, f) for f in dataclasses.fields(launcher_api.LaunchConfig) if f.name != "shutdown_timeout"]
    older = dataclasses.make_dataclass("LaunchConfig", [(name, kind, f) for name, kind, f in fields])
    monkeypatch.setattr(launcher_api, "LaunchConfig", older)
    config = local.launch_config(_plan(elastic), node_rank=0, log_specs=None)
    assert isinstance(config, older) and config.nproc_per_node == 2
    assert not hasattr(config, "shutdown_timeout")


def test_shutdown_timeout_reaches_a_torch_that_has_it() -> None:
    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(launcher_api.LaunchConfig)}:
        pytest.skip("this torch's LaunchConfig has no shutdown_timeout")
    config = local.launch_config(_plan(False), node_rank=0, log_specs=None)
    assert config.shutdown_timeout == local.SHUTDOWN_TIMEOUT_S
