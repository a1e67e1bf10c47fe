"""Compression through the engine on 2 gloo ranks at ZeRO stages 2 and 3 (one spawn): topk row pruning (its
learned scores live in a submodule whose own forward never runs, so ZeRO-3 must still gather them) and weight
quantization, stepped by the engine; after 3 steps every parameter, scores included, equals a single-process
run that steps the scheduler by hand."""

from __future__ import annotations

import torch
from torch import nn

import slipstream
from slipstream.compression import compression_scheduler, init_compression
from tests.harness import run_distributed, run_subtests

STEPS, BATCH = 3, 8
SECTION = {
    "row_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 1},
        "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}},
    },
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0},
        "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 6}, "modules": ["fc2"]}},
    },
}


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("fc1", nn.Linear(4, 6))
    net.add_module("act", nn.ReLU())
    net.add_module("fc2", nn.Linear(6, 2))
    return init_compression(net, {"compression_training": SECTION})


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH, 4, generator=generator) + 1.0 for _ in range(STEPS)]


def run_case(rank: int, world: int, *, stage: int) -> dict[str, torch.Tensor]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    config = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
        "compression_training": SECTION,
    }
    engine, *_ = slipstream.initialize(model=model(), config=config)
    share = BATCH // world
    for x in batches():
        engine.backward(engine(x[rank * share : (rank + 1) * share]).pow(2).mean())
        engine.step()
    from slipstream.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return params


def grid(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    return run_subtests([{"stage": s} for s in (2, 3)], lambda **case: run_case(rank, world, **case))


def reference() -> dict[str, torch.Tensor]:
    net = model()
    scheduler = compression_scheduler(net, {"compression_training": SECTION})
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler.step(step_zero_check=True)
    for x in batches():
        optimizer.zero_grad()
        net(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_engine_compression_matches_one_process_at_each_stage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    expected = reference()
    assert "fc1.row_pruning.scores" in expected
    for rank_results in run_distributed(grid, world_size=2, tmp_dir=tmp_path):
        for stage, params in zip((2, 3), rank_results):
            assert params.keys() == expected.keys(), stage
            for name, value in expected.items():
                torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {name}")
