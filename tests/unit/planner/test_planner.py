"""The planner without a process group: the engine's layout rules by hand, the stage-3 schedule replay, model
shapes (HF configs with known parameter counts), options and the cheapest fit, DeepSpeed's estimator names,
output shape and values (against DeepSpeed's formulas, by hand), the engine hooks, and the `slipstream plan`
command."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from slipstream.planner import (
    STANDARD_OPTIONS,
    Option,
    Settings,
    engine_line,
    estimate,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    format_plan,
    materialised_warning,
    should_warn_materialised,
)
from slipstream.planner.activations import transformer_activations
from slipstream.planner.prefetch import UnitShape, simulate_pool
from slipstream.planner.shapes import Dims, from_hf_config
from slipstream.planner.zero_bytes import optimizer_states_per_element, pinned_rounding, stage012_bytes

GIB = 2**30
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "hidden_act": "silu",
             "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


def test_stage012_bytes_follow_the_padded_bucket_layout() -> None:
    # numels 5, 3, 7 in buckets of at most 8 (reverse order): [7], [3, 5] -> padded to 8 and 8 on 2 ranks
    settings = Settings(dtype="bf16", reduce_bucket_size=8, pin_memory=False, device_is_host=False)  # a GPU
    zero2 = stage012_bytes([5, 3, 7], 0, stage=2, world=2, settings=settings, offload=False)
    assert zero2.owned == {"params": 16 * 2, "grads": 8 * 4, "comm_buffers": 2 * 8 * 4 + 2 * 4 * 4, "master": 8 * 4,
                           "optimizer_state": 2 * 8 * 4, "host_buffers": 0}
    zero1 = stage012_bytes([5, 3, 7], 4, stage=1, world=2, settings=settings, offload=True)
    assert zero1.owned["grads"] == 16 * 4 and zero1.owned["host_buffers"] == 8 * 4 + 8 * 2
    assert zero1.device["master"] == 0 and zero1.host["master"] == 8 * 4 and zero1.device["frozen_params"] == 8
    # on the CPU accelerator the fp32 gradients are host memory already: only the bf16 output buffer remains
    on_cpu = dataclasses.replace(settings, device_is_host=True)
    assert stage012_bytes([5, 3, 7], 4, stage=1, world=2, settings=on_cpu, offload=True).owned["host_buffers"] == 8 * 2
    fp32 = stage012_bytes([5, 3, 7], 0, stage=0, world=2, settings=Settings(dtype="fp32"), offload=False)
    assert fp32.owned["master"] == 0 and fp32.owned["optimizer_state"] == 2 * 16 * 4  # aliased master, stage 0


def test_optimizer_states_and_pinned_rounding() -> None:
    assert optimizer_states_per_element("AdamW") == 2
    assert optimizer_states_per_element("adam", [("amsgrad", True)]) == 3
    assert optimizer_states_per_element("sgd") == 0 and optimizer_states_per_element("sgd", [("momentum", 0.9)]) == 1
    assert pinned_rounding([3 * 2**20, 2**20]) == 2**20


def _units(sizes: list[int], persistent: int = 0) -> list[UnitShape]:
    units = [UnitShape(name=f"u{i}", numels=(n,), trainable=(True,)) for i, n in enumerate(sizes)]
    units.append(UnitShape(name="<root>", numels=(), trainable=(), is_root=True))
    if persistent:
        units.append(UnitShape(name="<persistent>", numels=(persistent,), trainable=(True,), persistent=True,
                               hooked=False, hosts=(0,)))
    return units


def test_gather_pool_replays_prefetch() -> None:
    units = _units([100, 100, 100])
    wide = simulate_pool(units, world=2, dtype_bytes=2, prefetch_numel=10**6, max_live_numel=10**9)
    assert wide.buffers == 3 and wide.pool_bytes == 3 * 2 * 51 * 2  # every unit in flight at once
    narrow = simulate_pool(units, world=2, dtype_bytes=2, prefetch_numel=50, max_live_numel=10**9)
    assert narrow.buffers == 1  # nothing fits the prefetch budget: one buffer, reused
    assert simulate_pool(units, world=1, dtype_bytes=2, prefetch_numel=10**6, max_live_numel=10**9).buffers == 0


def test_held_gradients_do_not_wait_for_the_persistent_unit() -> None:
    plain = simulate_pool(_units([100, 200, 300]), world=2, dtype_bytes=2, prefetch_numel=0, max_live_numel=10**9)
    assert plain.held_grads_peak_bytes == 300 * 2  # each unit is reduced as soon as it is complete
    with_persistent = simulate_pool(_units([100, 200, 300], persistent=10), world=2, dtype_bytes=2, prefetch_numel=0,
                                    max_live_numel=10**9)
    # the persistent unit completes last and is reduced last (Stage3Optimizer._order): nothing waits for it
    assert with_persistent.held_grads_peak_bytes == 300 * 2


def test_hf_configs_give_known_parameter_counts() -> None:
    assert from_hf_config(LLAMA2_7B).total == 6_738_415_616
    assert from_hf_config(GPT2).total == 124_439_808


def test_estimate_rows_fits_and_cheapest() -> None:
    plan = estimate(params=7e9, gpus_per_node=8, seq=4096, micro_batch=1, vocab=32000,
                    device_memory=80 * 10**9, host_memory=512 * 10**9)
    assert [e.option for e in plan.estimates] == list(STANDARD_OPTIONS)
    assert abs(plan.total_params - 7e9) < 1e6
    zero0, zero3 = plan.estimate_for("zero0"), plan.estimate_for("zero3")
    padding = zero0.device["optimizer_state"] - 2 * 4 * plan.trainable_params  # up to world-1 elements per bucket
    assert 0 <= padding < 2 * 4 * 8 * 200
    assert zero3.device["params"] < zero0.device["params"] / 7
    assert zero0.fits_device is False and plan.cheapest is not None
    cheapest = plan.estimate_for(plan.cheapest)
    cheaper = [e for e in plan.estimates if e.option.cost_rank < cheapest.option.cost_rank]
    assert all(not (e.fits_device and e.fits_host) for e in cheaper)
    text = format_plan(plan)
    assert f"*{plan.cheapest}" in text and "cheapest option that fits" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["options"][0]["device_bytes"]["optimizer_state"] == zero0.device["optimizer_state"]


def test_ds_config_row_and_knobs() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "offload_optimizer": {"device": "cpu"}}}
    plan = estimate(hf_config=GPT2, ds_config=config, gpus_per_node=4, seq=1024)
    row = plan.estimates[0]
    assert row.option == Option(stage=2, offload_optimizer=True, label="config")
    assert plan.settings.reduce_bucket_size == 1000
    gpt2 = Dims(hidden=768, layers=12, heads=12, vocab=50257)
    assert row.activations == transformer_activations(gpt2, seq=1024, micro_batch=4, dtype_bytes=2,
                                                      checkpointing=False)
    # buckets of 1000 elements: the embedding (50257 x 768) gets a bucket of its own, reduced in chunks of the
    # staging bound (8 MiB of fp32 gradients over 4 ranks), so the buffers do not grow with it
    chunk = 8 * 2**20 // 4 // 4
    assert row.device["comm_buffers"] == 2 * chunk * 4 * 4 + 2 * chunk * 4
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        Option(stage=2, offload_param=True)


def test_activation_formula() -> None:
    dims = Dims(hidden=4096, layers=32, heads=32)
    base = {"seq": 2048, "micro_batch": 1, "dtype_bytes": 2}
    per_layer = 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert transformer_activations(dims, **base, checkpointing=False) == int(32 * per_layer)
    assert transformer_activations(dims, **base, checkpointing=True) == int(32 * 2048 * 4096 * 2 + per_layer)
    assert transformer_activations(dims, **base, checkpointing=False, fused_attention=True) == 32 * 2048 * 4096 * 34


def test_deepspeed_names_signatures_and_output(capsys: pytest.CaptureFixture[str]) -> None:
    expected = {
        estimate_zero2_model_states_mem_needs_all_live: ["model", "num_gpus_per_node", "num_nodes",
                                                         "additional_buffer_factor"],
        estimate_zero2_model_states_mem_needs_all_cold: ["total_params", "num_gpus_per_node", "num_nodes",
                                                         "additional_buffer_factor"],
        estimate_zero3_model_states_mem_needs_all_live: ["model", "num_gpus_per_node", "num_nodes",
                                                         "additional_buffer_factor"],
        estimate_zero3_model_states_mem_needs_all_cold: ["total_params", "largest_layer_params", "num_gpus_per_node",
                                                         "num_nodes", "additional_buffer_factor"],
    }
    for fn, names in expected.items():
        assert list(inspect.signature(fn).parameters) == names
    rows = estimate_zero2_model_states_mem_needs_all_cold(1e9, num_gpus_per_node=8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["Estimated memory needed for params, optim states and gradients for a:",
                         "HW: Setup with 1 node, 8 GPUs per node."]
    assert re.fullmatch(r"SW: Model with (999|1000)M total params\.", lines[2])
    assert lines[3] == "  per CPU  |  per GPU |   Options"
    assert re.fullmatch(r" +\d+\.\d\dGB \| +\d+\.\d\dGB \| offload_optimizer=cpu ", lines[4])
    assert len(lines) == 6 and lines[5].endswith("offload_optimizer=none") and len(rows) == 2
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    estimate_zero3_model_states_mem_needs_all_cold(1e9, 4e7, num_gpus_per_node=2, num_nodes=2)
    estimate_zero2_model_states_mem_needs_all_live(model)
    out = capsys.readouterr().out
    assert out.count("zero_init=1") == 6 and "HW: Setup with 2 nodes, 2 GPUs per node." in out


def test_engine_hooks() -> None:
    from slipstream.config import resolve

    plan = resolve({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                    "bf16": {"enabled": True}}, world_size=4)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    line = engine_line(plan=plan, model=model, world_size=4)
    assert "\n" not in line and line.startswith("planner: ZeRO-2") and "4,288 params" in line
    assert "(params " in line and ", optim " in line and ", comm+gather " in line  # the table's column names
    assert should_warn_materialised(2_000_000_000, 8, 1_000_000_000)
    assert not should_warn_materialised(2_000_000_000, 1, 1_000_000_000)
    assert not should_warn_materialised(10**6, 8, 10**9) and "zero.Init" in materialised_warning(10**10, 8)


def test_cli_json_png_and_cheap_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream.cli.main import main

    assert main(["plan", "--params", "1.3B", "--gpus-per-node", "2", "--json", "--device-memory", "24GB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 2 and len(data["options"]) == len(STANDARD_OPTIONS) and data["cheapest"]
    png = tmp_path / "plan.png"
    assert main(["plan", "--hidden", "256", "--layers", "2", "--png", str(png)]) == 0
    captured = capsys.readouterr()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "needs matplotlib" in captured.err and not png.exists()
    else:
        assert png.exists()
    assert main(["plan"]) == 2 and "give the model" in capsys.readouterr().err
    code = "import sys, slipstream.planner; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_nvme_option_moves_offloaded_state_to_disk() -> None:
    from slipstream.planner import estimate

    plan = estimate(params=1_000_000, hidden=64, layers=4, gpus_per_node=2, dtype="bf16")
    by_name = {e.option.name: e for e in plan.estimates}
    cpu, nvme = by_name["zero3+offload_optimizer+offload_param"], by_name["zero3+offload_optimizer+offload_param(nvme)"]
    # on the CPU accelerator the fp32 gradient shards are host memory, and NVMe offload swaps them too
    swapped = cpu.device["grads"] if plan.settings.device_is_host else 0
    assert nvme.nvme_per_rank == (
        cpu.host["master"] + cpu.host["optimizer_state"] + cpu.host["offloaded_params"] + swapped
    ) > 0
    assert "offloaded_params" not in nvme.host and nvme.device == cpu.device  # one sub-group: all grads held
    assert cpu.nvme_per_rank == 0


def test_nvme_stage3_holds_a_few_sub_groups_of_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO-3 with NVMe offload on the CPU accelerator: the host holds at most four sub-groups' gradients
    (offload/grad_swap.py), not the model's; CPU offload holds them all, and so does NVMe offload with
    SLIPSTREAM_NVME_GRADIENTS=memory (no gradient file on the disk then)."""
    from slipstream.planner import estimate

    monkeypatch.delenv("SLIPSTREAM_NVME_GRADIENTS", raising=False)

    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "sub_group_size": 100_000,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                                    "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}
    plan = estimate(params=4_000_000, hidden=64, layers=4, ds_config=config)
    if not plan.settings.device_is_host:
        pytest.skip("the gradient shards are device memory on this accelerator")
    mine = next(e for e in plan.estimates if e.option.label == "config")
    assert plan.settings.grad_accum_dtype == "fp32", plan.settings
    assert mine.owned["grads"] > 10 * 2 * 100_000 * 4  # the model's gradients: many sub-groups' worth
    assert mine.device["grads"] == (2 + 2) * 100_000 * 4, mine.device  # kept in backward, + 2 read by the step
    cpu_config = {**config, "zero_optimization": {**config["zero_optimization"],
                                                  "offload_optimizer": {"device": "cpu"}}}
    cpu = next(e for e in estimate(params=4_000_000, hidden=64, layers=4, ds_config=cpu_config).estimates
               if e.option.label == "config")
    assert cpu.device["grads"] == mine.owned["grads"], (cpu.device, mine.owned)
    assert mine.nvme_per_rank == cpu.host["master"] + cpu.host["optimizer_state"] + mine.owned["grads"] + (
        mine.owned["offloaded_params"]
    )
    monkeypatch.setenv("SLIPSTREAM_NVME_GRADIENTS", "memory")
    kept = next(e for e in estimate(params=4_000_000, hidden=64, layers=4, ds_config=config).estimates
                if e.option.label == "config")
    assert kept.device["grads"] == mine.owned["grads"], kept.device
    assert kept.nvme_per_rank == mine.nvme_per_rank - mine.owned["grads"], (kept.nvme_per_rank, mine.nvme_per_rank)


def _deepspeed_zero2(params: int, gpus: int, nodes: int, *, offload: bool, factor: float) -> tuple[int, int]:
    """DeepSpeed 0.19's estimate_zero2_model_states_mem_needs: (cpu bytes, gpu bytes)."""
    total_gpus = gpus * nodes
    if offload:
        return int(params * max(4 * total_gpus, 16) * factor), 2 * params
    return int(params * 4 * gpus * factor), 4 * params + int(16 * params / total_gpus)


def _deepspeed_zero3(params: int, largest: int, gpus: int, nodes: int, *, offload: bool, offload_params: bool,
                     zero_init: bool, factor: float) -> tuple[int, int]:
    """DeepSpeed 0.19's estimate_zero3_model_states_mem_needs: (cpu bytes, gpu bytes)."""
    total_gpus, gpus_factor, largest_bytes = gpus * nodes, 1 / nodes, 4 * largest
    if offload and offload_params:
        cpu = params * (18 * gpus_factor if zero_init else max(4 * gpus, 18 * gpus_factor)) * factor
        return int(cpu), largest_bytes
    if offload:
        cpu = params * (16 * gpus_factor if zero_init else max(4 * gpus, 16 * gpus_factor)) * factor
        return int(cpu), largest_bytes + int(2 * params / total_gpus)
    cpu = (largest if zero_init else params) * 4 * gpus * factor
    return int(cpu), largest_bytes + int(18 * params / total_gpus)


def test_deepspeed_estimators_against_deepspeed_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    """The printed numbers are the planner's (docs/planner.md), so they differ from DeepSpeed's fixed factors
    where the accounting differs; where it is the same, they are equal to the byte: the sharded model states
    (16 or 18 bytes per parameter over the world), the replicated bf16 parameters, the model build on the host.
    Checked on 2 nodes x 2 GPUs with additional_buffer_factor 2 (so the world and the factor both show)."""
    with torch.device("meta"):  # no biases: every tensor splits evenly over 4 ranks and none is persistent
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 1024, bias=False))
    p, largest, gpus, nodes, factor = 4096 * 4096 + 4096 * 1024, 4096 * 4096, 2, 2, 2.0
    world = gpus * nodes

    def states(row: Any, *roles: str) -> int:
        return sum(row.device[r] for r in roles)

    zero2 = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus, num_nodes=nodes,
                                                           additional_buffer_factor=factor)
    printed = capsys.readouterr().out.splitlines()[4:]
    offload, plain = zero2
    ds_cpu, ds_gpu = _deepspeed_zero2(p, gpus, nodes, offload=False, factor=factor)
    # DeepSpeed: fp16 params and grads on every rank (4P) plus 16 bytes per param sharded; Slipstream keeps no
    # full-size gradient (each one is reduced into its fp32 shard), so the same minus 2P
    assert plain.device["params"] == 2 * p and states(plain, "grads", "master", "optimizer_state") == 16 * p // world
    assert states(plain, "params", "grads", "master", "optimizer_state") == ds_gpu - 2 * p
    assert plain.host_total * factor == ds_cpu  # every rank of a node builds the model in fp32
    _, ds_gpu = _deepspeed_zero2(p, gpus, nodes, offload=True, factor=factor)
    assert offload.device["params"] == ds_gpu  # only the bf16 parameters stay on the device
    assert offload.host["master"] + offload.host["optimizer_state"] == 12 * p // world
    zero3 = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus, num_nodes=nodes,
                                                           additional_buffer_factor=factor)
    printed += capsys.readouterr().out.splitlines()[4:]
    flags = [(True, True, True), (True, True, False), (True, False, True), (True, False, False),
             (False, False, True), (False, False, False)]
    for row, (off, off_params, zero_init) in zip(zero3, flags, strict=True):
        assert (row.option.offload_optimizer, row.option.offload_param) == (off, off_params)
        ds_cpu, ds_gpu = _deepspeed_zero3(p, largest, gpus, nodes, offload=off, offload_params=off_params,
                                          zero_init=zero_init, factor=factor)
        if not off:  # 18 bytes per param over the world (2 param, 4 grad, 4 master, 8 Adam); the host: the build
            assert states(row, "params", "grads", "master", "optimizer_state") == ds_gpu - 4 * largest
            assert row.host_total * factor == ds_cpu
        elif not off_params:  # the bf16 parameter shard stays on the device: DeepSpeed's 2P / world
            assert row.device["params"] == ds_gpu - 4 * largest == 2 * p // world
        else:  # DeepSpeed's 18 bytes per param on the host, plus the bf16 copy the CPU Adam op writes (2)
            host = sum(row.host[r] for r in ("offloaded_params", "master", "optimizer_state", "host_buffers"))
            assert host * world == (18 + 2) * p and row.device["params"] == 0
    for line, row in zip(printed, [*zero2, *zero3], strict=True):  # the table shows these rows' numbers
        cpu, gpu = re.findall(r"(\d+\.\d\d)GB", line)
        assert (cpu, gpu) == (f"{row.host_total * factor / GIB:.2f}", f"{sum(row.device.values()) / GIB:.2f}")


def test_cli_plan_names_torch_autocast_and_counts_its_buffers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`slipstream plan` with a torch_autocast config names the safe modules' reduce dtype, and its comm buffers
    hold the bf16 staging ring beside the fp32 one ([Note: reduction buffers by dtype])."""
    from slipstream.cli.main import main

    section = {"stage": 2, "reduce_bucket_size": 300}
    config: dict = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": section}
    comm = {}
    for name, extra in (("plain", {}), ("autocast", {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**config, **extra}))
        args = ["plan", "--model", "tests.harness.models:TinyTransformer", "--gpus-per-node", "2", str(path)]
        assert main(args) == 0
        text = capsys.readouterr().out
        assert ("torch_autocast bf16: gradients of Linear, Conv1d, Conv2d, Conv3d reduced in it" in text) == (
            name == "autocast"
        )
        assert main([*args, "--json"]) == 0
        comm[name] = json.loads(capsys.readouterr().out)["options"][0]["owned_bytes"]["comm_buffers"]
    assert comm["autocast"] > comm["plain"]


def test_planner_leaves_the_models_reduce_dtypes_as_they_were() -> None:
    """The planner marks the safe modules' parameters with the engine's rule while it counts, and takes the marks
    off again: a model planned under torch_autocast and trained without it reduces every gradient in one dtype."""
    from slipstream.planner import estimate
    from slipstream.precision.reduce_dtypes import reduce_dtype_of
    from tests.harness.models import TinyTransformer

    model = TinyTransformer()
    config = {"train_micro_batch_size_per_gpu": 2, "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
              "zero_optimization": {"stage": 3}}
    plan = estimate(model=model, ds_config=config, gpus_per_node=2)
    assert plan.estimate_for("config").owned["comm_buffers"] > 0
    assert [reduce_dtype_of(p) for p in model.parameters()] == [None] * len(list(model.parameters()))
