"""`slipstream plan --largest`: the layer count found fits and one more layer does not, per option and resource;
the CPU accelerator adds device and host figures; the command line reads sizes and a directory's free space."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slipstream.planner import Option, estimate
from slipstream.planner.largest import _exceeds, largest

GiB = 2**30
SHAPE = dict(hidden=256, heads=4, vocab=1000, seq=32, micro_batch=1, dtype="fp32")


def _fits(layers: int, option_index: int, **limits: int | None) -> str:
    plan = estimate(layers=layers, **SHAPE, options=OPTIONS)
    return _exceeds(plan.estimates[option_index], device_memory=limits.get("device"), host_memory=limits.get("host"),
                    nvme_free=limits.get("nvme"), shared=bool(limits.get("shared")), checkpointing=False)


OPTIONS = (Option(stage=0), Option(stage=3, offload_optimizer=True, offload_param=True, nvme=True))


@pytest.mark.parametrize("limits", [dict(device=GiB // 4, host=4 * GiB), dict(host=GiB // 2, shared=True)])
def test_the_answer_fits_and_one_more_layer_does_not(limits: dict) -> None:
    shared = limits.pop("shared", False)
    answers = largest(**SHAPE, options=OPTIONS, device_memory=limits.get("device"), host_memory=limits.get("host"),
                      nvme_free=8 * GiB)
    assert [a.option for a in answers] == [o.name for o in OPTIONS]
    for index, answer in enumerate(answers):
        assert answer.layers >= 1, answer
        assert _fits(answer.layers, index, **limits, nvme=8 * GiB, shared=shared) == ""
        assert _fits(answer.layers + 1, index, **limits, nvme=8 * GiB, shared=shared) == answer.bound != ""
        assert answer.params == estimate(layers=answer.layers, **SHAPE, options=OPTIONS).total_params


def test_nvme_space_bounds_the_nvme_option_and_nothing_fits_without_room() -> None:
    roomy, tight = (largest(**SHAPE, options=OPTIONS, host_memory=GiB, nvme_free=free) for free in (GiB // 8, 10**6))
    assert roomy[1].bound == "nvme" and roomy[1].layers > 1
    assert tight[1].layers == 0 and tight[1].bound == "nvme" and tight[1].params == 0
    assert tight[0].layers == roomy[0].layers  # stage 0 does not use the disk


def test_the_shared_memory_of_the_cpu_accelerator_holds_less_than_a_separate_device() -> None:
    offload = (Option(stage=2, offload_optimizer=True),)  # parameters and grads on the device, Adam on the host
    separate = largest(**SHAPE, options=offload, device_memory=GiB, host_memory=GiB)[0]
    cpu = largest(**SHAPE, options=offload, host_memory=GiB)[0]  # the CPU accelerator: one memory
    assert 0 < cpu.layers < separate.layers


def test_a_machine_must_be_given() -> None:
    with pytest.raises(ValueError, match="give the machine"):
        largest(**SHAPE)


def test_the_command_line(tmp_path) -> None:
    command = [sys.executable, "-m", "slipstream.cli.main", "plan", "--largest", "--hidden", "256", "--heads", "4",
               "--vocab", "1000", "--seq", "32", "--dtype", "fp32", "--host-memory", "1GiB", "--json"]
    out = subprocess.run([*command, "--nvme-free", str(tmp_path)], capture_output=True, text=True, check=True)
    rows = {row["option"]: row for row in json.loads(out.stdout)["largest"]}
    assert rows["zero0"]["layers"] >= 1 and rows["zero0"]["bound"] == "host"
    missing = subprocess.run(command[:4] + ["--host-memory", "1GiB"], capture_output=True, text=True)
    assert missing.returncode == 2 and "--hidden" in missing.stderr
