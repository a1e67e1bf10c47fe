"""The search space (autotuning/space.py) and the command line around it (autotuning/command.py, tuner.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from slipstream.autotuning import command
from slipstream.autotuning.launches import Ran, cause
from slipstream.autotuning.space import (
    BUCKET_SIZES,
    PREFETCH_SIZES,
    SUB_GROUP_SIZES,
    candidate_config,
    data_parallel,
    grid,
    micro_batch_sizes,
    trial_config,
    tunable_config,
)
from slipstream.autotuning.tuner import better
from slipstream.config import resolve
from slipstream.launcher import runner

BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _plan(user: dict, world: int = 2, **tuning: object):  # type: ignore[no-untyped-def]
    return resolve({**user, "autotuning": tuning}, world_size=world).autotuning


def test_a_fixed_train_batch_size_is_kept_by_the_accumulation() -> None:
    user = {**BASE, "train_batch_size": 16}
    plan = _plan(user, max_train_micro_batch_size_per_gpu=16)
    assert micro_batch_sizes(plan) == [1, 2, 4, 8, 16]
    found = grid(plan, user, world=2)
    assert {(c.micro_batch, c.grad_accum) for c in found} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert {(c.stage, c.offload_optimizer) for c in found} == {(0, False)} | {(s, o) for s in (1, 2, 3) for o in (0, 1)}
    for candidate in found:
        config = candidate_config(user, candidate, world=2)
        assert resolve(config, world_size=2).batch.train_batch_size == 16
        assert "autotuning" not in config


def test_without_a_fixed_batch_the_largest_is_capped() -> None:
    user = {**BASE, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
    plan = _plan(
        user,
        world=1,
        max_train_batch_size=8,
        min_train_micro_batch_size_per_gpu=3,
        max_train_micro_batch_size_per_gpu=6,
        fast=False,
    )
    found = grid(plan, user, world=1)
    assert {c.micro_batch for c in found} == {3, 4}  # 6 x 2 accumulation > 8
    assert {c.reduce_bucket_size for c in found} == set(BUCKET_SIZES)
    config = trial_config(user, found[0], world=1, plan=plan, metric_path="/m.json")
    assert config["autotuning"] == {
        "enabled": True,
        "metric_path": "/m.json",
        "start_profile_step": 3,
        "end_profile_step": 5,
    }
    with pytest.raises(ValueError, match="min_train_micro_batch_size_per_gpu=9"):
        micro_batch_sizes(
            _plan(user, world=1, min_train_micro_batch_size_per_gpu=9, max_train_micro_batch_size_per_gpu=4)
        )


def test_the_script_config_argument_and_the_launcher_flags() -> None:
    assert command.config_position(["t.py", "--x", "1", "--deepspeed_config=c.json"]) == (
        ["t.py", "--x", "1", "--deepspeed_config", "c.json"],
        4,
    )
    with pytest.raises(ValueError, match="--deepspeed_config PATH"):
        command.config_position(["t.py", "--lr", "1"])
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    args = parser.parse_args(["--num_gpus", "2", "--no_local_rank", "--autotuning", "tune", "t.py", "--a"])
    assert command.launcher_flags(args) == ["--num_gpus", "2", "--no_local_rank"]


def test_the_deepspeed_script_reaches_the_tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.compat import scripts

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(command, "run_autotuning", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(sys, "argv", ["deepspeed", "--autotuning", "run", "--autotuning_memory", "1G", "t.py"])
    assert scripts.deepspeed() == 0
    assert (seen[0].autotuning, seen[0].autotuning_memory, seen[0].user_script) == ("run", 1 << 30, "t.py")


def test_a_failed_trial_says_why(tmp_path: Path) -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
    assert cause(Ran(code=1, seconds=1.0, output=oom), timeout_s=60, where=tmp_path) == "out of memory"
    assert cause(Ran(code=None, seconds=60.0, output=oom), timeout_s=60, where=tmp_path) == "timeout after 60 s"
    failed = Ran(code=1, seconds=1.0, output="Traceback\nRuntimeError: boom\n")
    assert cause(failed, timeout_s=60, where=tmp_path) == "exit status 1: RuntimeError: boom"
    assert better("latency", {"latency": 1.0}, {"latency": 2.0})
    assert not better("throughput", {"throughput": 1.0}, {"throughput": 2.0})


def test_activation_checkpointing_is_searched_when_the_config_configures_it(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from torch import nn

    from slipstream.autotuning.estimates import checkpointed_share, read_answer
    from slipstream.autotuning.select import estimated_throughput

    user = {**BASE, "train_batch_size": 8, "activation_checkpointing": {"partition_activations": False}}
    plan = _plan(user, world=1, min_train_micro_batch_size_per_gpu=4, max_train_micro_batch_size_per_gpu=4)
    found = [c for c in grid(plan, user, world=1) if c.stage == 0]
    assert [c.name for c in found] == ["z0_mbs4_gas2_noac", "z0_mbs4_gas2_ac"]
    off, on = found
    # the job sees the choice as the section being there or not
    assert resolve(candidate_config(user, on, world=1), world_size=1).activation_checkpointing is not None
    assert resolve(candidate_config(user, off, world=1), world_size=1).activation_checkpointing is None
    assert estimated_throughput(on) < estimated_throughput(off)  # the recomputed forward
    assert {c.activation_checkpointing for c in grid(plan, BASE, world=1)} == {None}  # no section: not searched
    # the planner's share of activations kept with checkpointing, for a model whose layers it can read
    model = nn.Linear(2, 2)
    assert checkpointed_share(model) is None
    model.config = SimpleNamespace(hidden_size=64, num_hidden_layers=8, num_attention_heads=4)  # type: ignore[assignment]
    assert checkpointed_share(model) == pytest.approx(1 / 8 + 1 / 17)
    answer = tmp_path / "answer.json"
    rows = {c.name: {"device": 1000, "host": 0} for c in found}
    answer.write_text(json.dumps({"candidates": rows, "activations_per_sample": 100, "checkpointed_share": 0.25}))
    figures = read_answer(answer, found)
    assert (figures[off.name].activations, figures[on.name].activations) == (400, 100)
    answer.write_text(json.dumps({"candidates": rows, "activations_per_sample": 100, "checkpointed_share": None}))
    assert read_answer(answer, found)[on.name].activations is None  # unknown: never the reason for a skip


def test_the_searched_zero_stages_follow_the_config() -> None:
    from slipstream.autotuning.space import tunable_config, zero_stages

    assert zero_stages(BASE) == (0, 1, 2, 3)
    assert zero_stages({"zero_optimization": {"stage": 2}}) == (2,)
    assert zero_stages({"zero_optimization": {"stage": [3, 1]}}) == (1, 3)
    assert zero_stages({"zero_optimization": {"stage": "all"}}) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="zero_optimization.stage=5"):
        zero_stages({"zero_optimization": {"stage": 5}})
    user = {**BASE, "train_batch_size": 4, "zero_optimization": {"stage": [0, 1], "overlap_comm": False}}
    assert resolve(tunable_config(user), world_size=1).zero.stage == 0
    plan = _plan(tunable_config(user), world=1, max_train_micro_batch_size_per_gpu=4)
    assert {(c.stage, c.offload_optimizer) for c in grid(plan, user, world=1)} == {(0, False), (1, False), (1, True)}


def test_stage_3_also_offloads_the_parameters() -> None:
    from torch import nn

    from slipstream.autotuning.estimates import estimate_config

    user = {**BASE, "train_batch_size": 4, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    plan = _plan(user, world=1, min_train_micro_batch_size_per_gpu=4, max_train_micro_batch_size_per_gpu=4)
    found = {c.name: c for c in grid(plan, user, world=1)}
    assert sorted(found) == [
        "z3_mbs4_gas1",
        "z3_offload_mbs4_gas1",
        "z3_offload_params_mbs4_gas1",
        "z3_params_mbs4_gas1",
    ]
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    figures = {}
    for name, candidate in found.items():
        config = candidate_config(user, candidate, world=1)
        stage3 = resolve(config, world_size=1).zero.stage3
        assert stage3 is not None and type(stage3.offload_param).__name__ == (
            "CpuTarget" if candidate.offload_param else "NoOffloadTarget"
        )
        figures[name] = estimate_config(config, module=model, world_size=1, gpus_per_node=1)
    # the parameters leave the device for the host
    assert figures["z3_offload_params_mbs4_gas1"][0] < figures["z3_offload_mbs4_gas1"][0]
    # the parameters alone offloaded: a config of its own, and the planner's device figure drops below stage 3's
    assert "offload_optimizer" not in candidate_config(user, found["z3_params_mbs4_gas1"], world=1)["zero_optimization"]
    assert figures["z3_params_mbs4_gas1"][0] < figures["z3_mbs4_gas1"][0]


def test_mp_size_divides_the_world_into_data_parallel_ranks_and_min_train_batch_size_drops_small_batches() -> None:
    user = {**BASE, "zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1}
    plan = _plan(user, world=4, mp_size=2, max_train_micro_batch_size_per_gpu=8, min_train_batch_size=8)
    assert data_parallel(4, plan) == 2
    found = grid(plan, user, world=data_parallel(4, plan))
    assert [c.micro_batch for c in found] == [4, 8]  # micro 1 and 2 on 2 data-parallel ranks stay under 8
    config = candidate_config(user, found[0], world=2)
    assert config["train_batch_size"] == 8  # 4 x 1 x the 2 data-parallel ranks, not the 4 ranks
    with pytest.raises(ValueError, match="autotuning.mp_size=3 does not divide the 4 ranks"):
        data_parallel(4, _plan(user, world=4, mp_size=3))


def test_nvme_offload_is_searched_at_stage_3_only_when_the_config_names_a_path() -> None:
    from torch import nn

    from slipstream.autotuning.estimates import estimate_config

    zero = {"stage": 3, "sub_group_size": 1000, "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme"}}
    user = {**BASE, "train_batch_size": 4, "zero_optimization": zero}
    plan = _plan(user, world=1, min_train_micro_batch_size_per_gpu=4, max_train_micro_batch_size_per_gpu=4)
    found = {c.name: c for c in grid(plan, user, world=1)}
    assert {n for n in found if "_nvme" in n} == {"z3_offload_nvme_mbs4_gas1", "z3_offload_params_nvme_mbs4_gas1"}
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    host = {}
    for name in ("z3_offload_mbs4_gas1", "z3_offload_nvme_mbs4_gas1", "z3_offload_params_nvme_mbs4_gas1"):
        config = candidate_config(user, found[name], world=1)
        stage3 = resolve(config, world_size=1).zero.stage3
        assert stage3 is not None
        if "nvme" in name:
            assert config["zero_optimization"]["offload_optimizer"] == {"device": "nvme", "nvme_path": "/local_nvme"}
        host[name] = estimate_config(config, module=model, world_size=1, gpus_per_node=1)[1]
    # the planner moves the optimizer's masters and states from the host to NVMe
    assert host["z3_offload_nvme_mbs4_gas1"] < host["z3_offload_mbs4_gas1"]
    without = {**user, "zero_optimization": {"stage": 3}}
    assert not [c for c in grid(plan, without, world=1) if c.offload_device == "nvme"]


def test_without_fast_stage_3_also_searches_the_prefetch_bucket_and_the_sub_group_size() -> None:
    user = {**BASE, "train_batch_size": 4, "zero_optimization": {"stage": [2, 3]}}
    plan = _plan(tunable_config(user), world=1, fast=False, min_train_micro_batch_size_per_gpu=4)
    plan = dataclasses.replace(plan, max_micro_batch_size=4)
    found = grid(plan, user, world=1)
    stage2 = [c for c in found if c.stage == 2]
    assert {(c.prefetch_bucket_size, c.sub_group_size) for c in stage2} == {(None, None)}
    plain3 = [c for c in found if c.stage == 3 and not c.offload_optimizer and not c.offload_param]
    assert {(c.reduce_bucket_size, c.prefetch_bucket_size, c.sub_group_size) for c in plain3} == {
        (r, p, s) for r in BUCKET_SIZES for p in PREFETCH_SIZES for s in SUB_GROUP_SIZES
    }
    config = candidate_config(user, plain3[0], world=1)
    stage3 = resolve(config, world_size=1).zero.stage3
    assert stage3 is not None and stage3.prefetch_numel == plain3[0].prefetch_bucket_size
    assert config["zero_optimization"]["sub_group_size"] == plain3[0].sub_group_size
    fast = grid(_plan(tunable_config(user), world=1, max_train_micro_batch_size_per_gpu=4), user, world=1)
    assert {(c.prefetch_bucket_size, c.sub_group_size) for c in fast} == {(None, None)}


def test_the_nvme_path_flag_opens_the_nvme_offloads(tmp_path: Path) -> None:
    from slipstream.cli import run as cli_run

    (tmp_path / "ds.json").write_text(json.dumps({**BASE, "train_batch_size": 4, "zero_optimization": {"stage": 3}}))
    parser = argparse.ArgumentParser()
    cli_run.add_arguments(parser)
    argv = ["--num_gpus", "1", "--autotuning", "tune", "t.py", "--deepspeed_config", str(tmp_path / "ds.json")]
    without = command.job_from_args(parser.parse_args(argv))
    assert not [c for c in grid(without.plan, without.user_config, world=1) if c.offload_device == "nvme"]
    job = command.job_from_args(parser.parse_args(["--autotuning_nvme_path", "/local_nvme", *argv]))
    nvme = [c for c in grid(job.plan, job.user_config, world=1) if c.offload_device == "nvme"]
    assert nvme and all(c.stage == 3 and c.offload_optimizer for c in nvme)
    config = candidate_config(job.user_config, nvme[0], world=1)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "nvme", "nvme_path": "/local_nvme"}
    # the flag alone offloads nothing: a candidate without offload has no offload section
    plain = next(c for c in grid(job.plan, job.user_config, world=1) if not c.offload_optimizer)
    assert "offload_optimizer" not in candidate_config(job.user_config, plain, world=1)["zero_optimization"]
